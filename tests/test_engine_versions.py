"""Per-token versions: the engine's spans checked against our record (engine_versions.py), and the cache key."""

from __future__ import annotations

import logging

import pytest

from slime.rollout.engine_versions import VersionLabels, cache_key, lag_spans, version_check_metrics
from slime.rollout.sampling_request import token_versions
from slime.utils.types import Sample


def reply_meta(n: int, spans: list[tuple[str, int, int]] | None, last: str) -> dict:
    """meta_info as SGLang builds it."""
    meta = {"weight_version": last}
    if spans is not None:
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    return meta


def label(meta: dict, n: int, sent: int, newest: int, sample: Sample | None = None):
    sample = sample or Sample(index=7, group_index=3)
    labels = VersionLabels("test")
    got = labels.label_tokens(sample, token_versions(meta, n, "test"), "weight_versions" in meta, sent, newest, "rid-7")
    return got, sample


def test_engine_spans_are_taken_when_they_agree_with_our_record():
    got, s = label(reply_meta(5, [("3", 0, 2), ("4", 2, 5)], "4"), 5, sent=3, newest=4)
    assert got == [3, 3, 4, 4, 4] and version_check_metrics([s]) == {
        "rollout/version_disagreements": 0.0, "rollout/versions_unreported_tokens": 0.0}


def test_without_spans_a_request_no_update_crossed_has_its_one_version():
    got, _ = label(reply_meta(4, None, "6"), 4, sent=6, newest=6)
    assert got == [6] * 4


def test_without_spans_a_crossed_request_is_labelled_with_the_oldest_version_it_may_have():
    """SGLang 0.5.15.post1 under a pause mode."""
    got, s = label(reply_meta(4, None, "7"), 4, sent=6, newest=7)
    assert got == 6 and s.metadata["versions_unreported"] == 4
    assert version_check_metrics([s])["rollout/versions_unreported_tokens"] == 4.0


def test_spans_outside_our_record_are_a_warning_a_metric_and_the_older_label(caplog):
    with caplog.at_level(logging.WARNING, "slime.rollout.engine_versions"):
        got, s = label(reply_meta(3, [("2", 0, 1), ("9", 1, 3)], "9"), 3, sent=4, newest=5)
    assert got == [2, 5, 5]  # the engine's older label kept, its newer one capped at what could have run
    assert s.metadata["version_disagreements"] == 1
    assert version_check_metrics([s])["rollout/version_disagreements"] == 1.0
    assert any("rid-7" in r.message and "sample 7" in r.message for r in caplog.records)


def test_versions_that_are_not_ints():
    got, _ = label(reply_meta(2, None, "default"), 2, sent=0, newest=0)
    assert got == 0
    with pytest.raises(ValueError, match="not integers"):
        label(reply_meta(2, None, "default"), 2, sent=0, newest=1)


def test_cache_key_names_the_version():
    assert cache_key(3) == "weights-v3" != cache_key(4)


def test_requests_carry_the_key_of_the_version_they_are_sent_at(base_args):
    """The /generate body's extra_key."""
    from slime.rollout.sampling_request import SampleRequester

    s = Sample(index=0, group_index=0, tokens=[1, 2, 3])
    req = SampleRequester(base_args, None, "http://127.0.0.1:1", {"temperature": 1.0}, 0, policy_version=4)
    assert req.payload(s)["extra_key"] == "weights-v4"
    assert req.payload(s, version=6)["extra_key"] == "weights-v6"
    stale = SampleRequester(base_args.replace(reuse_stale_kv=True), None, "http://127.0.0.1:1", {}, 0, policy_version=4)
    assert "extra_key" not in stale.payload(s)


def test_a_span_lag_gives_each_newer_spans_first_tokens_the_version_before():
    """In-place pause: the overlap scheduler's in-flight token lands in the newer span but is labelled the older."""
    assert lag_spans([3, 3, 4, 4, 4, 5, 5], 1) == [3, 3, 3, 4, 4, 4, 5]
    assert lag_spans([3, 3, 4], 0) == [3, 3, 4] and lag_spans([4, 4], 1) == [4, 4]
    got, _ = label(reply_meta(5, [("3", 0, 2), ("4", 2, 5)], "4"), 5, sent=3, newest=4)
    labels = VersionLabels("test")
    lagged = labels.label_tokens(Sample(index=1, group_index=1), [3, 3, 4, 4, 4], True, 3, 4, "rid", span_lag=1)
    assert got == [3, 3, 4, 4, 4] and lagged == [3, 3, 3, 4, 4]
