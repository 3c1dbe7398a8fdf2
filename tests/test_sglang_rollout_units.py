"""Engine-free pieces of the rollout: reply parsing, staleness policies, per-token version metrics."""

from __future__ import annotations

import asyncio

import pytest

from slime.rollout.rollout_metrics import running_requests, token_version_metrics
from slime.rollout.sampling_request import GenerateResponseError, SampleRequester, parse_segment, sampling_params_from_args
from slime.rollout.staleness import StalenessCap
from slime.utils.types import Sample, Status


def reply(ids, finish="stop", version="3", lps=None):
    lps = lps if lps is not None else [[-0.5 - i, t, None] for i, t in enumerate(ids)]
    return {"text": "x" * len(ids), "output_ids": ids,
            "meta_info": {"id": "r", "finish_reason": {"type": finish}, "weight_version": version,
                          "output_token_logprobs": lps}}


def test_parse_segment_checks_the_contract():
    ids, lps, v, text, f = parse_segment(reply([5, 6]), "u")
    assert (ids, lps, v, text, f) == ([5, 6], [-0.5, -1.5], [3, 3], "xx", "stop")
    assert parse_segment(reply([], "abort"), "u")[4] == "abort"
    assert parse_segment(reply([5], version="default"), "u")[2] is None
    with pytest.raises(GenerateResponseError, match="output_token_logprobs"):
        parse_segment(reply([5, 6], lps=[[-0.1, 5, None]]), "u")
    with pytest.raises(GenerateResponseError, match="is for token 9"):
        parse_segment(reply([5], lps=[[-0.1, 9, None]]), "u")
    with pytest.raises(GenerateResponseError, match="finish_reason"):
        parse_segment(reply([5], finish="weird"), "u")


def test_parse_segment_labels_each_token_from_weight_version_spans():
    """A segment that crossed an in-flight weight update: tokens 0-1 from version 3, 2-4 from version 4."""
    out = reply([5, 6, 7, 8, 9], version="4")
    out["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    ids, lps, versions, _, _ = parse_segment(out, "u")
    assert versions == [3, 3, 4, 4, 4]
    s = Sample(index=0, group_index=0, tokens=[1, 2])
    s.append_response(ids, lps, versions)
    assert s.weight_versions == [3, 3, 4, 4, 4] and sum(v < 4 for v in s.weight_versions) == 2
    empty = reply([], "abort")
    empty["meta_info"]["weight_versions"] = [{"version": "7", "start": 0, "end": 0}]
    assert parse_segment(empty, "u")[2] == []
    out["meta_info"]["weight_versions"][1]["version"] = "v4"
    assert parse_segment(out, "u")[2] is None  # not ints: the requester falls back to its policy version
    for bad in ([{"version": "3", "start": 0, "end": 2}],  # covers 2 of 5 tokens
                [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 3, "end": 5}],  # a gap
                []):
        out["meta_info"]["weight_versions"] = bad
        with pytest.raises(GenerateResponseError, match="weight_versions"):
            parse_segment(out, "u")


def sample(versions, status=Status.ABORTED, mask=None, budget=None):
    s = Sample(index=1, group_index=0, tokens=[1, 2])
    if versions:
        s.append_response(list(range(3, 3 + len(versions))), [-0.1] * len(versions), versions, "", loss_mask=mask)
    s.status = status
    if budget is not None:
        s.metadata["max_response_len"] = budget
    return s


@pytest.mark.parametrize("policy", ["restart", "mask", "keep"])
def test_staleness_policies_touch_only_stale_samples(policy):
    """Only members with an old token still in the loss (or unfinished with any old token) get the policy."""
    stale, fresh, done = sample([0, 0, 2]), sample([2, 3]), sample([0, 1], Status.COMPLETED)
    done_masked = sample([0, 2], Status.COMPLETED, mask=[0, 1])  # its old token is already out of the loss
    counts = StalenessCap(1, policy).at_resume([[stale, fresh, done, done_masked]], train_version=3)
    assert counts[policy] == 2 and counts["stale_groups"] == 1
    assert fresh.weight_versions == [2, 3] and fresh.loss_mask == [1, 1]
    assert done_masked.weight_versions == [0, 2] and done_masked.loss_mask == [0, 1]
    assert done_masked.status == Status.COMPLETED
    if policy == "restart":  # both are generated again with the group
        for s in (stale, done):
            assert s.tokens == [1, 2] and s.response_length == 0 and s.status == Status.PENDING and s.reward is None
        assert counts["restarted_tokens"] == 5
    elif policy == "mask":  # the old tokens leave the loss, the finished member stays finished
        assert stale.loss_mask == [0, 0, 1] and done.loss_mask == [0, 0] and counts["masked_tokens"] == 4
        assert stale.response_length == 3 and done.status == Status.COMPLETED
    else:
        assert stale.loss_mask == [1, 1, 1] and done.loss_mask == [1, 1]
    assert not StalenessCap(None, policy).at_resume([[sample([0])]], 3)  # no cap: nothing happens


@pytest.mark.parametrize("policy", ["restart", "mask", "keep"])
def test_the_cap_at_every_site(policy):
    cap = StalenessCap(1, policy)
    # one sample resumed in flight (train_async.py's gate): the same policy, counted as in flight
    s = sample([0, 2])
    c = cap.at_resume_in_flight(s, 3)
    assert c["stale_samples_in_flight"] == 1 and c[policy] == 1
    assert not cap.at_resume_in_flight(sample([2, 3]), 3)
    # before training (stream batches, groups held ready): a loss-masked old token makes the group stale; restart
    # hands it back, mask masks, keep keeps
    old, masked_old = [sample([1, 2], Status.COMPLETED)], [sample([1, 2], Status.COMPLETED, mask=[0, 1])]
    kept, stale, counts = cap.before_training([old, masked_old], 3)
    assert counts["stale_groups_at_train"] == 1 and masked_old in kept  # its old token is already out of the loss
    assert (stale == [old]) == (policy == "restart") and (old in kept) == (policy != "restart")
    assert counts["masked_tokens_at_train"] == (1 if policy == "mask" else 0)
    assert StalenessCap(None, policy).before_training([old], 9) == ([old], [], {})
    # in-place updates abort requests below this version only under restart
    assert cap.restart_floor(5) == (4 if policy == "restart" else None)
    with pytest.raises(ValueError, match="staleness-policy"):
        StalenessCap(1, "drop")


def test_token_version_metrics_are_exact_per_token():
    g = [[sample([0, 1, 2], Status.COMPLETED), sample([2, 2], Status.TRUNCATED, mask=[0, 1])]]
    m = token_version_metrics(g, current_version=2)
    assert m["rollout/trained_tokens"] == 4 and m["rollout/off_policy_tokens"] == 2
    assert m["rollout/off_policy_token_ratio"] == 0.5
    assert (m["rollout/staleness_hist/lag_0"], m["rollout/staleness_hist/lag_1"], m["rollout/staleness_hist/lag_2"]) == (2, 1, 1)
    assert m["rollout/versions_per_sample_max"] == 3 and m["rollout/versions_per_sample_mean"] == 2


def test_requester_payload_budget_and_sampling_params(base_args):
    args = base_args.replace(rollout_max_response_len=10, rollout_temperature=0.7, rollout_top_p=0.9,
                             rollout_top_k=5, rollout_stop=None, rollout_stop_token_ids=[2],
                             eval_temperature=0.0, eval_top_p=0.9)
    sp = sampling_params_from_args(args)
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["stop_token_ids"]) == (0.7, 0.9, 5, [2])
    assert sampling_params_from_args(args, evaluation=True)["temperature"] == 0.0
    req = SampleRequester(args, None, "http://x", sp, 4, 1)
    s = sample([0, 0, 0])
    p1, p2 = req.payload(s), req.payload(s)
    assert p1["input_ids"] == [1, 2, 3, 4, 5] and p1["sampling_params"]["max_new_tokens"] == 7
    assert p1["return_logprob"] is True and p1["rid"] != p2["rid"]
    assert req.payload(sample([0], budget=4))["sampling_params"]["max_new_tokens"] == 3


def test_sample_at_its_budget_is_truncated_without_a_request(base_args):
    args = base_args.replace(rollout_max_response_len=3)
    req = SampleRequester(args, None, "http://unused", {}, 0, 0)
    s = sample([0, 0, 0])
    assert asyncio.run(req.generate(s)) is True and s.status == Status.TRUNCATED and req.requests == 0


def test_running_requests_parses_the_load_report():
    # SGLang's /v1/loads?include=core
    v1 = {"version": "0.5.23", "loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 5,
                                          "max_running_requests": 8},
                                         {"dp_rank": 1, "num_running_reqs": 1, "max_running_requests": 8}]}
    assert running_requests(v1) == (4, 16)
    # the legacy /get_load, on a server without /v1/loads
    assert running_requests([{"num_reqs": 3, "max_running_requests": 8}, {"num_reqs": 1, "max_running_requests": 8}]) == (4, 16)
    assert running_requests({"num_running_reqs": 2}) == (2, None)


def test_an_abort_that_arrived_with_the_end_token_finishes_the_sample(base_args, tmp_path, monkeypatch):
    """SGLang applies an abort arriving with a token before checking that token (`Req.update_finish_state`)."""
    import json

    from slime.backends.sglang_utils import http_client
    from slime.utils.hf_dir import eos_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    assert eos_token_ids(str(tmp_path)) == {2, 9}
    args = base_args.replace(hf_checkpoint=str(tmp_path), rollout_max_response_len=10)
    replies = []

    async def engine(session, url, payload, timeout=None):
        return replies.pop(0)

    monkeypatch.setattr(http_client, "generate", engine)
    for ids, params, status in [([7, 2], {}, Status.COMPLETED), ([7, 9], {}, Status.COMPLETED),
                                ([7, 5], {"stop_token_ids": [5]}, Status.COMPLETED), ([7, 5], {}, Status.ABORTED),
                                ([7, 2], {"ignore_eos": True}, Status.ABORTED), ([], {}, Status.ABORTED)]:
        replies.append(reply(ids, "abort", version="1"))
        s = sample([])
        req = SampleRequester(args, None, "http://x", params, 0, 1)
        asyncio.run(req.send(s))
        assert s.status == status and s.tokens[s.prompt_length:] == ids, (ids, params)
