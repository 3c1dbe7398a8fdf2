"""Length bias (slime/rollout/length_bias.py)."""

from __future__ import annotations

import pytest

from slime.rollout.length_bias import length_bias_metrics, sync_estimate
from slime.rollout.staleness import CUT_KEY, StalenessCap
from slime.utils.types import Sample, Status


def sample(n: int, cut: int | None = None) -> Sample:
    s = Sample(index=0, group_index=0, tokens=[1] * (3 + n), response_length=n, loss_mask=[1] * n,
               rollout_log_probs=[-1.0] * n, weight_versions=[0] * n, status=Status.COMPLETED)
    if cut is not None:
        s.metadata[CUT_KEY] = cut
    return s


def test_first_attempts_make_the_synchronous_estimate():
    """Nothing restarted: the estimate is the synchronous run's; cut first attempts keep the longest decile missing."""
    lengths = list(range(1, 101))
    m = length_bias_metrics([sample(n) for n in lengths], generated=[sample(n) for n in lengths[:50]])
    assert m["length/trained_mean"] == pytest.approx(m["length/sync_mean"]) == pytest.approx(50.5)
    assert m["length/longest_decile_share"] == pytest.approx(1.0)
    assert m["length/generated_p90"] == 46 and m["length/trained_p50"] == 51
    # the 10 longest were cut at their first attempt (at 120, beyond any finished one) and trained short
    biased = [sample(n) for n in lengths[:90]] + [sample(5, cut=120) for _ in range(10)]
    m = length_bias_metrics(biased)
    assert m["length/sync_mean"] == pytest.approx((sum(range(1, 91)) + 10 * 120) / 100)  # cut at 120 or later
    assert m["length/trained_mean"] == pytest.approx((sum(range(1, 91)) + 50) / 100)
    assert m["length/sync_p90"] == 90 and m["length/longest_decile_share"] == pytest.approx((1 / 100) / 0.11)
    # groups the cap dropped as stale count on the synchronous side only
    m = length_bias_metrics([sample(n) for n in lengths[:90]], dropped=[sample(n) for n in lengths[90:]])
    assert m["length/sync_p90"] == 90 and m["length/longest_decile_share"] == pytest.approx((1 / 90) / 0.11)


def test_the_cap_records_a_restarted_samples_first_attempt():
    s = Sample(index=0, group_index=0, tokens=[1, 2, 3], status=Status.ABORTED)
    s.append_response([4, 5, 6, 7], [-1.0] * 4, [0, 0, 0, 0])
    counts = StalenessCap(0, "restart").at_resume([[s]], train_version=2)
    assert counts["restart"] == 1 and s.response_length == 0 and s.metadata[CUT_KEY] == 4
    s.append_response([8, 9], [-1.0] * 2, [2, 2])
    s.append_response([1], [-1.0], [3])
    StalenessCap(0, "restart").at_resume([[s]], train_version=5)
    assert s.metadata[CUT_KEY] == 4  # the first attempt's, not the second's
    est = sync_estimate([s, sample(2)])
    assert est.quantile(0.99) == 4  # censored at 4: at least as long as that


def test_empty_steps_have_no_length_metrics():
    assert length_bias_metrics([]) == {}


def test_the_run_summary_says_it_in_one_line():
    from slime.utils.summary import length_line, summarize

    rows = [{"step": i, "length/trained_mean": 10.0 + i, "length/sync_mean": 14.0, "length/trained_p90": 30.0,
             "length/sync_p90": 40.0, "length/longest_decile_share": 0.5} for i in range(4)]
    s = summarize(rows)
    assert s["length_trained_mean"] == 11.5 and s["length_longest_decile_share"] == 0.5
    line = length_line(s)
    assert "11.5 / p90 30.0" in line and "14.0 / 40.0" in line and "0.50x" in line
    assert length_line(summarize([{"step": 0}])) == "length bias: n/a"
