"""Upstream slime's plugin API, with upstream's meaning."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from slime.rollout.buffer import PartialRolloutBuffer
from slime.utils.engine_reply import GenerateResponseError
from slime.utils.types import Sample, SampleInvariantError, Status, expand_fanout

STOP = {"type": "stop"}


def prompt_sample(index=0, group=3) -> Sample:
    return Sample(index=index, group_index=group, prompt="p", tokens=[1, 2, 3], label="42")


# ---- Sample ------------------------------------------------------------------------------------------------
def test_append_response_tokens_model_and_tool_tokens():
    s = prompt_sample()
    s.append_response_tokens(None, tokens=[10, 11], log_probs=[-0.5, -0.25], trainable=True, text="ab",
                             meta_info={"weight_version": "4", "finish_reason": {"type": "length"}})
    assert s.status is Status.TRUNCATED  # the reply's finish reason
    s.append_response_tokens(None, tokens=torch.tensor([12, 13]), trainable=False, text="<tool>")
    s.append_response_tokens(None, tokens=[14], log_probs=torch.tensor([-1.0]), text="c",
                             meta_info={"weight_versions": [{"version": 5, "start": 0, "end": 1}],
                                        "finish_reason": STOP})
    assert s.tokens == [1, 2, 3, 10, 11, 12, 13, 14] and s.response == "ab<tool>c" and s.response_length == 5
    assert s.loss_mask == [1, 1, 0, 0, 1] and s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, -1.0]
    assert s.weight_versions == [4, 4, 4, 4, 5]  # tool tokens: the version of the token before them
    assert s.status is Status.COMPLETED and s.effective_response_length == 3
    s.check()


def test_append_response_tokens_version_unknown_until_the_step_fills_it():
    s = prompt_sample()
    s.append_response_tokens(None, tokens=[10], log_probs=[-0.1], meta_info={"weight_version": "default"})
    s.append_response_tokens(None, tokens=[11], log_probs=[-0.1])  # no meta_info at all
    assert s.status is Status.PENDING  # no finish reason given
    s.complete_response(7, "plugin")
    assert s.weight_versions == [7, 7]


def test_append_response_tokens_terminal_info_can_be_left_alone():
    s = prompt_sample()
    s.append_response_tokens(None, tokens=[10], log_probs=[-0.1], update_terminal_info=False,
                             meta_info={"weight_version": 1, "finish_reason": {"type": "length"}})
    assert s.status is Status.PENDING and s.weight_versions == [1]


def test_append_response_tokens_refuses_what_upstream_refuses():
    s = prompt_sample()
    with pytest.raises(SampleInvariantError, match="trainable tokens need their rollout log_probs"):
        s.append_response_tokens(None, tokens=[10])
    with pytest.raises(SampleInvariantError, match="non-trainable tokens take no log_probs"):
        s.append_response_tokens(None, tokens=[10], log_probs=[-0.1], trainable=False)
    with pytest.raises(SampleInvariantError, match="2 log_probs for 1 tokens"):
        s.append_response_tokens(None, tokens=[10], log_probs=[-0.1, -0.2])
    with pytest.raises(GenerateResponseError, match="weight_versions cover 2 tokens"):
        s.append_response_tokens(None, tokens=[10], log_probs=[-0.1],
                                 meta_info={"weight_versions": [{"version": 1, "start": 0, "end": 2}]})
    assert s.response_length == 0 and s.tokens == [1, 2, 3]


def test_a_retried_sample_reset_upstreams_way_grows_again():
    """retool's generate resets a retried sample upstream's way (log-probs None, empty mask) and it grows again."""
    s = prompt_sample()
    s.append_response_tokens(None, tokens=[10, 11], log_probs=[-0.1, -0.2], meta_info={"weight_version": 2})
    s.rollout_log_probs, s.loss_mask, s.response, s.response_length, s.tokens = None, [], "", 0, [1, 2, 3]
    s.append_response_tokens(None, tokens=[12], log_probs=[-0.3], meta_info={"weight_version": 3})
    assert (s.tokens, s.weight_versions, s.rollout_log_probs, s.loss_mask) == ([1, 2, 3, 12], [3], [-0.3], [1])
    s.rollout_log_probs = None  # trainable tokens cannot follow a response whose log-probs were thrown away
    with pytest.raises(SampleInvariantError, match="no rollout_log_probs"):
        s.append_response_tokens(None, tokens=[13], log_probs=[-0.1])


def test_get_reward_value_reads_reward_key(base_args):
    s = prompt_sample()
    s.reward = {"score": -1.0, "acc": False}
    assert s.get_reward_value(base_args.replace(reward_key="score")) == -1.0
    with pytest.raises(KeyError, match="--reward-key 'nope'"):
        s.get_reward_value(base_args.replace(reward_key="nope"))
    s.reward = 0.5
    assert s.get_reward_value(base_args) == 0.5


def test_attributes_a_plugin_sets_travel_with_the_sample_into_the_buffer(tmp_path, base_args):
    s = prompt_sample()
    s.append_response_tokens(None, tokens=[10], log_probs=[-0.1], meta_info={"weight_version": 1})
    s.tool_call_count, s.status = 2, Status.ABORTED
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.tool_call_count == 2
    buffer = PartialRolloutBuffer(base_args)
    buffer.issue([[s]])
    buffer.park([[s]])
    buffer.save(str(tmp_path / "buffer.json"))
    again = PartialRolloutBuffer(base_args)
    again.load(str(tmp_path / "buffer.json"))
    assert again.take_parked(1)[0][0].tool_call_count == 2


# ---- remove_sample, rollout_id and upstream's other Sample fields ----------------------------------------------
def finished(index: int, n: int, reward: float, **fields) -> Sample:
    s = Sample(index=index, group_index=index // 10, tokens=[1, 2], reward=reward, **fields)
    s.append_response([5] * n, [-0.1] * n, 0)
    s.status = Status.COMPLETED
    return s


def test_remove_sample_keeps_a_sample_out_of_the_loss_not_out_of_its_group(base_args):
    """Upstream (THUDM/slime 624b824, `_convert_samples_to_train_data`)."""
    from slime.backends.training_utils.data import flatten_groups
    from slime.backends.training_utils.loss import compute_rollout_tensors
    from slime.rollout.rollout_metrics import sample_metrics, token_version_metrics

    def advantages(group):
        items, _ = flatten_groups([group])
        old = [torch.zeros(it.response_len) for it in items[0]]
        return items[0], compute_rollout_tensors(base_args, items, old, None).advantages

    group = [finished(0, 3, 1.0), finished(1, 2, 0.0), finished(2, 4, 0.0)]
    kept_items, kept = advantages(copy.deepcopy(group))
    group[1].remove_sample = True
    items, adv = advantages(group)
    assert items[1].loss_mask.tolist() == [0.0, 0.0] and group[1].loss_mask == [1, 1]  # the sample keeps its own
    assert items[1].reward == 0.0 and [it.loss_mask.tolist() for it in (items[0], items[2])] == \
        [it.loss_mask.tolist() for it in (kept_items[0], kept_items[2])]
    torch.testing.assert_close(adv[0], kept[0])  # the group's mean and std still count it
    torch.testing.assert_close(adv[2], kept[2])
    assert sample_metrics([group])["rollout/removed_samples"] == 1.0
    assert token_version_metrics([group], 1)["rollout/trained_tokens"] == 7.0  # 3 + 4: none of the removed one's
    back = Sample.from_dict(json.loads(json.dumps(group[1].to_dict())))  # parked with it, it stays removed
    assert back.remove_sample and back.trained_loss_mask == [0, 0]
    back.reset_response()  # a staleness restart drops the response it was a verdict on
    assert not back.remove_sample


def test_samples_sharing_a_rollout_id_are_one_rollout_in_the_loss(base_args):
    """Upstream (THUDM/slime 624b824: `rollout_mask_sums`, `build_dp_schedule`)."""
    from slime.backends.training_utils.data import flatten_groups, rollout_tokens, split_steps
    from slime.backends.training_utils.loss import RolloutTensors, loss_inputs

    group = [finished(0, 3, 1.0, rollout_id=7), finished(1, 2, 0.0), finished(2, 1, 0.0, rollout_id=7),
             finished(3, 2, 1.0)]
    items = flatten_groups([group])[0][0]
    steps = split_steps([it.rollout for it in items], 2)
    assert steps == [[0, 2, 1], [3]]  # rollout 7 (two samples) and sample 1; then sample 3
    step = [items[p] for p in steps[0]]
    per_rollout = rollout_tokens(step)
    assert sorted(per_rollout.values()) == [2.0, 4.0]
    rt = RolloutTensors([torch.zeros(it.response_len) for it in items], None,
                        [torch.zeros(it.response_len) for it in items], None, {})
    inp = loss_inputs(base_args, rt, steps[0], [it.loss_mask for it in step], sum(per_rollout.values()),
                      len(per_rollout), "cpu", [per_rollout[it.rollout] for it in step])
    # 2 rollouts: each of rollout 7's 4 tokens weighs 1/4/2, each of sample 1's 2 tokens 1/2/2
    assert inp.weight.tolist() == [0.125] * 3 + [0.125] + [0.25] * 2
    assert not base_args.calculate_per_token_loss
    with pytest.raises(TypeError, match="rollout_id 'a'.*an int"):
        finished(4, 1, 0.0, rollout_id="a").complete_response(0, "--custom-generate-function-path p.g")


@pytest.mark.parametrize("name, value, why", [
    ("multimodal_inputs", {"images": ["x.png"]}, "multimodal inputs are not supported"),
    ("multimodal_train_inputs", {"pixel_values": torch.zeros(1)}, "multimodal inputs are not supported"),
    ("apply_chat_template_kwargs", {"enable_thinking": False}, "per-sample chat-template arguments"),
    ("rollout_top_p_token_ids", [3, 4], "top-p token replay"),
    ("rollout_routed_experts", torch.zeros(2, 1, 1), "MoE routing replay"),
    ("teacher_log_probs", [-0.1], "on-policy distillation"),
    ("train_metadata", {"loss": "sft"}, "custom losses"),
    ("generate_function_path", "m.g", "a per-sample generate"),
    ("custom_rm_path", "m.r", "a per-sample reward function"),
])
def test_upstream_fields_with_no_meaning_here_are_refused_when_a_plugin_sets_them(name, value, why):
    s = finished(0, 1, 1.0)
    assert getattr(s, name) in (None, {})  # a plugin reads upstream's default
    setattr(s, name, None if name != "apply_chat_template_kwargs" else {})  # retool / search-r1 reset them
    s.complete_response(0, "plugin")
    setattr(s, name, value)
    with pytest.raises(ValueError, match=f"--rollout-function-path p.r: sample 0 sets {name} .*{why}"):
        s.complete_response(0, "--rollout-function-path p.r")


def test_upstream_fields_kept_for_the_plugin(tmp_path):
    """`session_id` and `non_generation_time` are kept, also in the buffer's checkpoints."""
    from slime.rollout.rollout_metrics import sample_metrics

    a, b = finished(0, 1, 1.0), finished(1, 1, 0.0)
    assert a.session_id is None and a.non_generation_time == 0.0
    assert "rollout/non_generation_time_mean" not in sample_metrics([[a, b]])
    a.session_id, a.non_generation_time = "s-0", 3.0
    a.complete_response(0, "plugin")
    back = Sample.from_dict(json.loads(json.dumps(a.to_dict())))
    assert (back.session_id, back.non_generation_time) == ("s-0", 3.0)
    m = sample_metrics([[back, b]])
    assert (m["rollout/non_generation_time_mean"], m["rollout/non_generation_time_max"]) == (1.5, 3.0)


# ---- fan-out: a custom generate returning a list -------------------------------------------------------------
def generated(carrier: Sample, tokens: list[int], reward=None) -> Sample:
    s = copy.deepcopy(carrier)
    s.append_response_tokens(None, tokens=tokens, log_probs=[-0.1] * len(tokens), meta_info={"finish_reason": STOP})
    s.reward = reward
    return s


def test_a_fanout_joins_its_group_when_rewarded():
    carrier, other = prompt_sample(0), prompt_sample(1)
    a, b = generated(carrier, [10], reward=1.0), generated(carrier, [11, 12])
    b.index = None
    assert carrier.adopt_fanout([a, b], 6, "plugin") is True
    assert carrier.response_length == 1 and carrier.reward == 1.0 and carrier.fanout == [b]  # the first of them
    assert b.index == 0 and b.group_index == 3 and b.weight_versions == [6, 6]
    kept = Sample.from_dict(json.loads(json.dumps(carrier.to_dict())))  # a group parked with its fan-out keeps it
    assert kept == carrier and kept.fanout[0].tokens == [1, 2, 3, 11, 12]
    group = [kept, other]
    assert expand_fanout(group) is group and [s.response_length for s in group] == [1, 2, 0]
    assert all(not s.fanout for s in group)


def test_a_fanout_holding_the_given_sample_keeps_it_first():
    carrier = prompt_sample()
    other = generated(carrier, [11])
    carrier.append_response_tokens(None, tokens=[10], log_probs=[-0.1], meta_info={"finish_reason": STOP})
    assert carrier.adopt_fanout([other, carrier], 1, "plugin") and carrier.tokens[-1] == 10
    assert carrier.fanout == [other]


def test_an_interrupted_fanout_is_generated_again():
    carrier = prompt_sample()
    done, cut = generated(carrier, [10]), copy.deepcopy(carrier)
    cut.status = Status.ABORTED
    assert carrier.adopt_fanout([done, cut], 1, "plugin") is False
    assert carrier.status is Status.ABORTED and not carrier.fanout and carrier.response_length == 0


@pytest.mark.parametrize("returned, match", [([], "empty list"), ([3], "item 0 is a int"),
                                             ("group", "group_index 9")])
def test_a_bad_fanout_is_refused_naming_the_plugin(returned, match):
    carrier = prompt_sample()
    if returned == "group":
        returned = [generated(carrier, [10])]
        returned[0].group_index = 9
    with pytest.raises((TypeError, ValueError), match=match):
        carrier.adopt_fanout(returned, 1, "--custom-generate-function-path p.g")


def test_a_rollout_functions_fanned_out_groups_are_flattened():
    """Upstream's rollout output may hold a list in a sample's place."""
    from slime.rollout.base_types import RolloutFnTrainOutput, to_rollout_output

    carrier = prompt_sample()
    a, b, c = (generated(carrier, [t]) for t in (10, 11, 12))
    out = to_rollout_output(RolloutFnTrainOutput(samples=[[[a, b], c]]), "--rollout-function-path f", 2)
    assert out.groups == [[a, b, c]] and all(s.weight_versions == [2] for s in out.groups[0])
