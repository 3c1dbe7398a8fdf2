"""Upstream slime's plugin API beyond `Sample` (tests/test_upstream_plugin_api.py)."""

from __future__ import annotations

import asyncio
import copy
import pickle

import pytest

from slime.rollout.buffer import PartialRolloutBuffer
from slime.rollout.filter_hub import DynamicFilterOutput, call_dynamic_filter, group_filter
from slime.rollout.rm_hub import grade_answer_verl, reward_group
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward
from slime.rollout.rm_hub.math_dapo_utils import compute_score
from slime.rollout.rm_hub.math_utils import extract_answer
from slime.rollout.sampling_request import RequestLoop, args_with_router
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.misc import SingletonMeta
from slime.utils.plugin_args import PluginArgs, plugin_args, run_flags
from slime.utils.types import Sample, Status

from test_upstream_plugin_api import STOP, prompt_sample


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


