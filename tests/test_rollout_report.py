"""The rollout benchmark's report arithmetic (benchmarks/rollout_report.py): spreads and the re-prefill share."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from rollout_report import reprefill_share, spread, step_cost_fit  # noqa: E402


def fit_sums(steps):
    """The engine's fit_* sums (SchedulerStats.add_step) over (seconds, decoded rows, prefill tokens) steps."""
    d = dict(fit_n=0, fit_d=0.0, fit_p=0.0, fit_dd=0.0, fit_pp=0.0, fit_dp=0.0, fit_t=0.0, fit_td=0.0, fit_tp=0.0)
    for t, rows, tok in steps:
        r, p = rows / 1000.0, tok / 1000.0
        d["fit_n"] += 1
        d["fit_d"] += r
        d["fit_p"] += p
        d["fit_dd"] += r * r
        d["fit_pp"] += p * p
        d["fit_dp"] += r * p
        d["fit_t"] += t
        d["fit_td"] += t * r
        d["fit_tp"] += t * p
    return d


def test_step_fit_and_reprefill_share_recover_a_known_cost():
    # steps costing 2 ms + 30 us per row + 5 us per prefilled token
    steps = [(2e-3 + 30e-6 * r + 5e-6 * p, r, p) for r in (10, 60, 120) for p in (0, 100, 512, 900)]
    a, b, c = step_cost_fit(fit_sums(steps))
    assert (a, b, c) == pytest.approx((2e-3, 30e-6, 5e-6), rel=1e-6)
    engine = {**fit_sums(steps), "prefill_tokens": 400_000, "cache_hits": 0}
    res = {"sync": {"engine": engine, "wall_s": 10.0, "tok_s": 1000.0},
           "april": {"engine": engine, "wall_s": 10.0, "tok_s": 2000.0},
           "april_kv": {"engine": {**engine, "cache_hits": 5}, "wall_s": 10.0, "tok_s": 2500.0}}
    out = reprefill_share(res, limit_tok_s=4000.0)
    assert set(out) == {"april"}  # sync resumes nothing; a stale-KV mode re-prefills nothing
    r = out["april"]
    assert r["seconds"] == pytest.approx(2.0) and r["share"] == pytest.approx(0.2)
    assert r["without_tok_s"] == pytest.approx(2500.0) and r["without_over_limit"] == pytest.approx(0.625)


def test_spread_is_a_t_interval():
    sp = spread([1.0, 1.0, 1.0])
    assert sp["mean"] == 1.0 and sp["std"] == 0.0 and sp["ci90"] == 0.0
    sp = spread([0.6, 0.7])
    assert sp["std"] == pytest.approx(0.0707, abs=1e-4) and sp["ci90"] == pytest.approx(6.314 * 0.0707 / 2 ** 0.5, rel=1e-3)
    assert spread([0.5])["ci90"] == float("inf")


def test_graph_captures_are_no_measured_steps_cost_and_the_validity_names_what_broke_it(capsys):
    """A mode's step, or a limit slice, pays no CUDA graph capture (SGLang captures at start-up)."""
    from rollout_report import validity
    from rollout_workload import without_captures

    assert without_captures(4.478, 2.231) == pytest.approx(2.247)  # sync on the Pareto workload, an H200 (2026-11-28)
    assert without_captures(1.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="another interval"):
        without_captures(1.0, 1.5)

    class Limit:
        engine = {"cuda_graph_capture_s": 0.476}

    res = {m: {"engine": {"cuda_graph_capture_s": c}} for m, c in (("sync", 0.967), ("april", 0.315), ("pool", 0.2))}
    v = validity(512, {"april": True, "pool": True, "limit": False}, [False, True], res, Limit())
    assert v["valid"] is False and v["why_not"] == ["limit warmed up for fewer than 512 engine steps"]
    assert v["graph_capture_s_taken_out"] == {"sync": 0.967, "april": 0.315, "pool": 0.2, "limit": 0.476}
    assert (v["calibration_passes"], v["calibration_passes_complete"]) == (2, 1)
    assert "NOT VALID: limit warmed up" in capsys.readouterr().out
    v = validity(512, {"april": True, "limit": True}, None, res, Limit())  # no --simulate
    assert v["valid"] and v["calibration_passes"] is None
