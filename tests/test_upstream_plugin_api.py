"""Upstream slime's plugin API, with upstream's meaning: what its examples (search-r1, retool, tau-bench,
multi_agent) call on `Sample`, `GenerateState`, `SingletonMeta`, the rm_hub helpers and filters, and the args
they write to. The plugins these tests use are ours, written to upstream's contract (tests/upstream_plugins.py);
tests/test_upstream_plugins_e2e.py runs them through the rollout and the quick start."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle

import pytest
import torch

from slime.rollout.buffer import PartialRolloutBuffer
from slime.rollout.filter_hub import DynamicFilterOutput, call_dynamic_filter, group_filter
from slime.rollout.rm_hub import grade_answer_verl, reward_group
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.rm_hub.math_utils import extract_answer
from slime.rollout.sampling_request import RequestLoop, args_with_router
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.engine_reply import GenerateResponseError
from slime.utils.misc import SingletonMeta
from slime.utils.plugin_args import PluginArgs, plugin_args, run_flags
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
    """retool's generate resets a retried sample by setting rollout_log_probs=None, loss_mask=[] and
    response_length=0 (upstream keeps versions per request, so it never trims them)."""
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
    """Upstream (THUDM/slime 624b824, `_convert_samples_to_train_data`): a removed sample's loss mask is zeroed
    when it becomes training data; its reward still counts in its group's normalization."""
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
    """Upstream (THUDM/slime 624b824: `rollout_mask_sums`, `build_dp_schedule`): samples with one `rollout_id`
    share an optimizer step, and a sample-mean loss divides their tokens by the rollout's loss tokens and the step's
    rollouts."""
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
    """`session_id` (upstream's routing key, read by the plugin's own requests) and `non_generation_time` (reported
    as rollout/non_generation_time_*) are kept, also in the buffer's checkpoints."""
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


# ---- the args plugins get ------------------------------------------------------------------------------------
def test_plugins_write_to_their_args_without_changing_the_runs_flags(base_args):
    args = base_args.replace()
    view = plugin_args(args)
    assert isinstance(view, PluginArgs) and view is plugin_args(args) is plugin_args(view)
    view.rollout_max_response_len = 7  # upstream's multi_agent overwrites flags on its args
    view.tokenizer = "kept for the next call"
    assert args.rollout_max_response_len == 1024 and run_flags(view) is args
    with pytest.raises(AttributeError, match="read-only"):
        args.tokenizer = "x"
    routed = args_with_router(args, "http://127.0.0.1:4567")
    assert routed is view and (view.sglang_router_ip, view.sglang_router_port) == ("127.0.0.1", 4567)
    assert args.sglang_router_port is None
    # another process (a Ray actor) gets the flags without this process's view, and makes its own
    other = pickle.loads(pickle.dumps(args))
    assert "_plugin_view" not in vars(other) and plugin_args(other).rollout_max_response_len == 1024
    mine = copy.deepcopy(view)  # multi_agent deep-copies the args it was given and writes to the copy
    mine.sample = "x"
    assert not hasattr(view, "sample")


# ---- GenerateState, SingletonMeta ----------------------------------------------------------------------------
def test_generate_state_as_upstreams_plugins_use_it(tiny_model_dir, base_args):
    args = base_args.replace(hf_checkpoint=tiny_model_dir, sglang_server_concurrency=3, rollout_max_response_len=9,
                             rollout_temperature=0.7)
    state = GenerateState(plugin_args(args))
    assert GenerateState(plugin_args(args)) is state  # one per process, as upstream
    assert state.tokenizer.encode("a b", add_special_tokens=False) and state.processor is None
    assert state.sampling_params["max_new_tokens"] == 9 and state.sampling_params["temperature"] == 0.7
    assert state.sampling_params["no_stop_trim"] is True

    async def slots():
        sem = state.semaphore
        assert state.semaphore is sem
        async with sem:
            return sem, sem._value

    (sem1, free1), (sem2, _) = asyncio.run(slots()), asyncio.run(slots())
    assert free1 == 2 and sem1 is not sem2  # 3 slots x 1 engine; each event loop its own semaphore
    GenerateState.clear_instances()


async def waits_for_the_abort(args, sample: Sample, sampling_params: dict) -> Sample:
    """A multi-turn generate's check between turns (upstream's `if state.aborted:`), here its only work."""
    state = GenerateState(args)
    sample.seen = [state.aborted]
    args.plugin_started.set()
    while not state.aborted:
        await asyncio.sleep(0.01)
    sample.seen.append(state.aborted)
    sample.status = Status.ABORTED
    return sample


def test_generate_state_aborted_follows_the_step_the_generate_runs_for(tiny_model_dir, base_args):
    from slime.rollout.sampling_request import SampleRequester

    args = base_args.replace(hf_checkpoint=tiny_model_dir,
                             custom_generate_function_path=f"{__name__}.waits_for_the_abort")
    requester = SampleRequester(args, None, "http://127.0.0.1:1", {}, rollout_id=0, policy_version=0)

    async def step():
        plugin_args(args).plugin_started = started = asyncio.Event()
        stop, s = asyncio.Event(), prompt_sample()
        task = asyncio.create_task(requester.generate(s, stop))
        await started.wait()
        outside = GenerateState(plugin_args(args)).aborted  # no step here
        stop.set()  # the step has its batch: it aborts the engines
        return await task, s, outside

    done, s, outside = asyncio.run(step())
    assert done is False and s.status is Status.ABORTED and s.seen == [False, True] and outside is False
    with pytest.raises(AttributeError, match="set by the rollout step"):
        GenerateState(plugin_args(args)).aborted = True
    GenerateState.clear_instances()


def test_singleton_meta():
    class Box(metaclass=SingletonMeta):
        def __init__(self, value):
            self.value = value

    assert Box(1) is Box(2) and Box(3).value == 1
    Box.clear_instances()
    assert Box(4).value == 4


# ---- filters ---------------------------------------------------------------------------------------------------
def rewarded(*rewards) -> list[Sample]:
    return [Sample(index=i, group_index=1, reward=r, status=Status.COMPLETED) for i, r in enumerate(rewards)]


class StepAt:
    """What group_filter reads of a step: accepted and failed groups, groups in play, the target."""

    def __init__(self, accepted: int, open_groups: int, target: int):
        self.accepted, self.failed, self.target = [[]] * accepted, [], target
        self._open = [object()] * open_groups

    def open_groups(self):
        return self._open


def test_keep_when_insufficient_keeps_a_rejected_group_only_when_the_step_runs_short(base_args):
    args = base_args.replace(
        dynamic_sampling_filter_path="slime.rollout.filter_hub.dynamic_sampling_filters."
                                     "check_reward_nonzero_std_with_fallback")
    same = rewarded(1.0, 1.0)
    assert group_filter(args)(same, StepAt(accepted=1, open_groups=2, target=3)) is None  # 3 candidates: kept
    assert group_filter(args)(same, StepAt(accepted=1, open_groups=3, target=3)) == "all rewards equal (=1)"
    assert group_filter(args)(rewarded(0.0, 1.0), StepAt(accepted=0, open_groups=1, target=3)) is None
    plain = base_args.replace(dynamic_sampling_filter_path="tests.upstream_plugins.rewards_differ")
    assert group_filter(plain)(same, StepAt(accepted=0, open_groups=1, target=3)) == "filtered"  # a bool filter
    assert DynamicFilterOutput(False, keep_when_insufficient=True).drops(candidates=2, target=None)


def test_a_filter_keep_may_be_a_tensor(base_args, tmp_path, monkeypatch):
    (tmp_path / "tensor_filter.py").write_text(
        "import torch\nfrom slime.rollout.filter_hub.base_types import DynamicFilterOutput\n"
        "def f(args, samples, **kwargs):\n"
        "    keep = torch.tensor([s.reward for s in samples], dtype=torch.float64).std() > 1e-6\n"
        "    return DynamicFilterOutput(keep=keep, reason=None if keep else 'zero_std')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert call_dynamic_filter("tensor_filter.f", base_args, rewarded(0.0, 1.0)) == DynamicFilterOutput(True)
    assert call_dynamic_filter("tensor_filter.f", base_args, rewarded(1.0, 1.0)).keep is False


def parked_groups(*lengths) -> list[list[Sample]]:
    out = []
    for gid, n in enumerate(lengths):
        s = Sample(index=gid, group_index=gid, tokens=[1], status=Status.ABORTED)
        s.append_response([2] * n, [-0.1] * n, 0)
        out.append([s])
    return out


def test_buffer_filter_with_upstreams_four_arguments(base_args):
    buffer = PartialRolloutBuffer(base_args.replace(buffer_filter_path="tests.upstream_plugins.longest_first"))
    groups = parked_groups(1, 5, 3)
    buffer.issue(groups)
    buffer.park(groups)
    assert [g[0].group_index for g in buffer.take_parked(2)] == [1, 2]  # it popped from the list it was given
    assert buffer.parked_ids() == [0]


def legacy_three(args, buffer, num):
    return buffer[-num:]


def five_arguments(args, rollout_id, buffer, num, extra):
    return []


def test_buffer_filter_signatures(base_args):
    buffer = PartialRolloutBuffer(base_args.replace(buffer_filter_path=f"{__name__}.legacy_three"))
    groups = parked_groups(1, 2)
    buffer.issue(groups)
    buffer.park(groups)
    assert [g[0].group_index for g in buffer.take_parked(1)] == [1]
    with pytest.raises(TypeError, match="five_arguments takes 5 positional.*rollout_id, buffer, num_samples"):
        PartialRolloutBuffer(base_args.replace(buffer_filter_path=f"{__name__}.five_arguments"))


# ---- rewards -----------------------------------------------------------------------------------------------
def test_a_reward_set_by_the_generate_is_kept_and_checked(base_args):
    args = base_args.replace(custom_rm_path="tests.upstream_plugins.dapo_reward")
    samples = [prompt_sample(i) for i in range(3)]
    for s in samples:
        s.append_response_tokens(None, tokens=[10], log_probs=[-0.1], text="42", meta_info={"finish_reason": STOP})
    samples[0].reward, samples[1].reward = 0.25, {"no": 1}
    asyncio.run(reward_group(args, samples))
    assert samples[0].reward == 0.25  # as upstream: a reward the custom generate set is not recomputed
    assert samples[1].status is Status.FAILED and "--reward-key" in samples[1].metadata["failure"]
    assert samples[2].reward == 1.0  # math_dapo_utils' +1
    assert plugin_args(args).upstream_rewards == 1  # the reward plugin kept its count on the args it got


# (response, label, upstream's verdict): answers upstream's DeepScaleR grader accepts that ours used to reject
DEEPSCALER_VERDICTS = [
    (r"\text{45 degrees}", "45", 1), (r"\text{12 hours}", "12", 1), (r"2\pi \text{ cm}", r"2\pi", 1),
    (r"2\pi cm", r"2\pi", 1), (r"\infty cm", r"\infty", 1), (r"\boxed{7}", "7", 1), ("X+1", "x+1", 1),
    (r"\text{(a)}", r"\text{(A)}", 1), ("{x=3}", "x=3", 1), (r"\text{1,000 degrees}", "1,000", 1),
    (r"\text{46 degrees}", "45", 0), ("X+2", "x+1", 0), (r"\text{(b)}", r"\text{(A)}", 0),
]


@pytest.mark.parametrize("answer, label, verdict", DEEPSCALER_VERDICTS)
def test_deepscaler_gives_upstreams_verdicts(answer, label, verdict):
    assert get_deepscaler_rule_based_reward(f"reasoning</think> so \\boxed{{{answer}}}", label) == verdict
    assert grade_answer_verl(f"\\boxed{{{answer}}}", label) is bool(verdict)


def test_rm_hub_helpers_with_upstreams_signatures():
    assert extract_answer(r"a \boxed{\frac{1}{2}} b") == r"\frac{1}{2}" and extract_answer("just 42") is None
    assert grade_answer_verl(r"\boxed{42}", r"\boxed{42}") and not grade_answer_verl(r"\boxed{42}", "")
    assert not grade_answer_verl("42", "42")  # no boxed answer
    assert compute_score("work\nAnswer: 42,", "42") == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score("Answer: 41", "42")["score"] == -1.0
    assert compute_score(r"so \boxed{42}", "42", strict_box_verify=True) == {"score": 1.0, "acc": True, "pred": "42"}
    assert compute_score(r"\boxed{42}" + "x" * 100, "42", strict_box_verify=True)["score"] == -1.0  # tail only


# ---- --rollout-max-context-len -------------------------------------------------------------------------------
def test_rollout_max_context_len(base_args, tmp_path):
    from slime.arguments import ArgumentError, parse_args

    argv = ["--hf-checkpoint", base_args.hf_checkpoint, "--prompt-data", base_args.prompt_data, "--rm-type", "math",
            "--rollout-batch-size", "1", "--num-rollout", "1", "--run-dir", str(tmp_path)]
    args = parse_args(argv + ["--rollout-max-context-len", "64"])
    assert (args.rollout_max_prompt_len, args.eval_max_context_len) == (63, 64)  # upstream's defaults
    with pytest.raises(ArgumentError, match="--rollout-max-prompt-len.*below --rollout-max-context-len"):
        parse_args(argv + ["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "64"])
    loop = RequestLoop(max_response_len=50)
    loop.max_context_len = 20
    s = prompt_sample()  # 3 prompt tokens
    assert loop.budget(s) == 17
    s.append_response([9] * 17, [-0.1] * 17, 0)
    assert loop.at_budget(s) and s.status is Status.TRUNCATED


def test_a_rollout_functions_fanned_out_groups_are_flattened():
    """Upstream's rollout output may hold a list in a sample's place (its generate_and_rm of a list-returning
    generate): each becomes a sample of that group."""
    from slime.rollout.base_types import RolloutFnTrainOutput, to_rollout_output

    carrier = prompt_sample()
    a, b, c = (generated(carrier, [t]) for t in (10, 11, 12))
    out = to_rollout_output(RolloutFnTrainOutput(samples=[[[a, b], c]]), "--rollout-function-path f", 2)
    assert out.groups == [[a, b, c]] and all(s.weight_versions == [2] for s in out.groups[0])
