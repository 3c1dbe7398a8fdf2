import json

import pytest

from slime.utils.types import Sample, SampleInvariantError, Status


def make(prompt_ids=(1, 2, 3)):
    return Sample(index=7, group_index=3, prompt="p", tokens=list(prompt_ids), label="x")


def test_append_keeps_fields_aligned():
    s = make()
    s.append_response([10, 11], [-0.1, -0.2], 0, text="ab")
    s.append_response([12], [-0.3], 2, text="c")
    assert s.tokens == [1, 2, 3, 10, 11, 12]
    assert s.prompt_tokens == [1, 2, 3] and s.response_tokens == [10, 11, 12]
    assert s.response == "abc" and s.response_length == 3
    assert s.rollout_log_probs == [-0.1, -0.2, -0.3]
    assert s.weight_versions == [0, 0, 2]
    assert s.loss_mask == [1, 1, 1]
    assert sum(v < 2 for v in s.weight_versions) == 2
    assert s.oldest_version() == 0


@pytest.mark.parametrize("logp, ver, mask", [([-0.1], 0, None), ([-0.1, -0.2], [0], None), ([-0.1, -0.2], 0, [1])])
def test_append_refuses_misaligned_segment(logp, ver, mask):
    s = make()
    with pytest.raises(SampleInvariantError):
        s.append_response([10, 11], logp, ver, loss_mask=mask)
    assert s.tokens == [1, 2, 3] and s.response_length == 0 and s.rollout_log_probs == []


def test_constructor_checks_invariant():
    with pytest.raises(SampleInvariantError, match="rollout_log_probs has 1 entries, response_length is 2"):
        Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_log_probs=[0.0], weight_versions=[0, 0])
    with pytest.raises(SampleInvariantError, match="response_length=5"):
        Sample(tokens=[1], response_length=5)


def test_dict_round_trip_is_lossless_and_json_safe():
    s = make()
    s.append_response([10, 11], [-0.125, -2.5], [1, 2], text="hi", loss_mask=[1, 0])
    s.status = Status.ABORTED
    s.reward = 0.5
    s.metadata = {"a": [1, 2]}
    d = json.loads(json.dumps(s.to_dict()))
    t = Sample.from_dict(d)
    assert t == s
    assert t.status is Status.ABORTED
    t.tokens.append(99)  # deep copy: the dict is not aliased
    assert d["tokens"][-1] == 11
    with pytest.raises(ValueError, match="unknown keys"):
        Sample.from_dict({**d, "bogus": 1})


def test_reset_and_mask_stale():
    s = make()
    s.append_response([10, 11, 12], [-1.0, -1.0, -1.0], [0, 1, 3])
    assert s.mask_tokens_older_than(2) == 2
    assert s.loss_mask == [0, 0, 1]
    s.status = Status.ABORTED
    s.reset_response()
    assert s.tokens == [1, 2, 3] and s.response_length == 0 and s.status is Status.PENDING
    assert s.loss_mask == [] and s.weight_versions == [] and s.rollout_log_probs == []


def test_finished_statuses():
    assert Status.COMPLETED.is_finished and Status.TRUNCATED.is_finished and Status.FAILED.is_finished
    assert not Status.ABORTED.is_finished and not Status.PENDING.is_finished
