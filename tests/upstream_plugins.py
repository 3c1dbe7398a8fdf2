"""Plugins written to upstream slime's documented contracts (docs/en/get_started/customization.md of THUDM/slime),
not ours: they import what upstream's plugins import, post to the router named by `args`, grow samples by setting
their fields and return upstream's output types. tests/test_upstream_compat.py and tests/test_upstream_plugins_e2e.py
run them through train.py."""

from __future__ import annotations

import asyncio

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rm_hub import async_rm
from slime.utils.http_utils import post
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """`--custom-generate-function-path`'s signature, `async def custom_generate(args, sample, sampling_params) ->
    Sample` (called by `generate_rollout` below). Like upstream's built-in generate: continues a partial sample
    from its tokens; max_new_tokens is the whole budget, so what the sample already has is taken off."""
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    assert sample.status in (Sample.Status.PENDING, Sample.Status.ABORTED), sample.status
    sampling_params = dict(sampling_params)
    sampling_params["max_new_tokens"] -= sample.response_length
    if sampling_params["max_new_tokens"] <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    output = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True})
    pairs = output["meta_info"]["output_token_logprobs"]
    sample.tokens = sample.tokens + [p[1] for p in pairs]
    sample.rollout_log_probs = (sample.rollout_log_probs or []) + [p[0] for p in pairs]
    sample.response += output["text"]
    sample.response_length += len(pairs)
    sample.loss_mask = (sample.loss_mask or []) + [1] * len(pairs)
    finish = output["meta_info"]["finish_reason"]["type"]
    sample.status = {"stop": Sample.Status.COMPLETED, "length": Sample.Status.TRUNCATED}.get(finish, Sample.Status.ABORTED)
    return sample


async def _generate_and_reward(args, sample: Sample, sampling_params: dict) -> Sample:
    sample = await generate(args, sample, sampling_params)
    sample.reward = await async_rm(args, sample)
    return sample


def _sampling_params(args, evaluation: bool) -> dict:
    return {"temperature": args.eval_temperature if evaluation else args.rollout_temperature,
            "top_p": args.rollout_top_p, "max_new_tokens": args.rollout_max_response_len,
            "no_stop_trim": True, "skip_special_tokens": False}


def generate_rollout(args, rollout_id: int, data_source, evaluation: bool = False):
    """`--rollout-function-path`: `def generate_rollout(args, rollout_id, data_source, evaluation=False)`; training
    takes `rollout_batch_size` groups with `data_source.get_samples` and returns `RolloutFnTrainOutput`;
    evaluation returns `RolloutFnEvalOutput` (its groups come with the data source, as its eval datasets)."""
    if evaluation:
        groups = data_source.eval_groups
    else:
        groups = data_source.get_samples(args.rollout_batch_size)

    async def run():
        sp = _sampling_params(args, evaluation)
        return await asyncio.gather(*(asyncio.gather(*(_generate_and_reward(args, s, sp) for s in g)) for g in groups))

    groups = [list(g) for g in asyncio.run(run())]
    if evaluation:
        samples = [s for g in groups for s in g]
        return RolloutFnEvalOutput(data={"upstream_eval": {
            "rewards": [s.reward for s in samples],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in samples], "samples": samples}})
    return RolloutFnTrainOutput(samples=groups, metrics={"upstream/groups": len(groups)})


# ---- plugins written the way upstream's examples are (search-r1, retool, multi_agent): GenerateState,
# Sample.append_response_tokens, rm_hub.math_dapo_utils, state kept on args --------------------------------------
FIRST_TURN = 2  # model tokens before the "tool" answers
TOOL_TEXT = ","  # the tool's answer: subtract_chain's separator, so a right answer stays right


def _router(args) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"


def _count(args, name: str) -> None:
    """State kept on args across calls, as upstream's plugins keep it."""
    setattr(args, name, getattr(args, name, 0) + 1)


async def _model_turn(args, state, sample: Sample, sampling_params: dict, max_new: int, final: bool) -> str:
    async with state.semaphore:
        output = await post(_router(args), {"input_ids": sample.tokens, "return_logprob": True,
                                            "sampling_params": {**sampling_params, "max_new_tokens": max_new}})
    meta = output["meta_info"]
    finish = meta["finish_reason"]["type"]
    pairs = meta["output_token_logprobs"]
    # a turn cut at its own budget does not end the sample
    sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs], trainable=True,
                                  meta_info=meta, text=output["text"], update_terminal_info=final or finish != "length")
    return finish


async def generate_with_state(args, sample: Sample, sampling_params: dict) -> Sample:
    """Upstream's built-in generate as a plugin: continues from `sample.tokens` (a sample the step parked resumes
    where it stopped), `max_new_tokens` is the whole budget (what the sample has is taken off)."""
    from slime.rollout.sglang_rollout import GenerateState

    state = GenerateState(args)
    _count(args, "upstream_generate_calls")
    assert sample.status in (Sample.Status.PENDING, Sample.Status.ABORTED), sample.status
    if not sample.tokens:
        sample.tokens = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
    left = sampling_params["max_new_tokens"] - sample.response_length
    if left <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    await _model_turn(args, state, sample, sampling_params, left, final=True)
    return sample


async def generate_multi_turn(args, sample: Sample, sampling_params: dict) -> Sample:
    """Two model turns with a tool's answer between them, like upstream's retool / search-r1: model tokens are
    trainable (log-probs and the engine's meta_info), the tool's are not; `--rollout-max-context-len` bounds the
    context. An abort anywhere leaves the sample resumable: it goes on from its tokens (`tool_called`, an
    attribute kept on the sample, says which turn it is in)."""
    from slime.rollout.sglang_rollout import GenerateState

    state = GenerateState(args)
    _count(args, "upstream_generate_calls")
    limit = sampling_params["max_new_tokens"]
    if args.rollout_max_context_len is not None:
        limit = min(limit, args.rollout_max_context_len - (len(sample.tokens) - sample.response_length))
    sample.status = Sample.Status.PENDING
    if not getattr(sample, "tool_called", False):
        room = min(FIRST_TURN, limit) - sample.response_length
        if room > 0:
            finish = await _model_turn(args, state, sample, sampling_params, room, final=False)
            if finish != "length":  # stop: answered without the tool; abort: resumed here later
                return sample
        ids = state.tokenizer.encode(TOOL_TEXT, add_special_tokens=False)[: max(0, limit - sample.response_length)]
        sample.append_response_tokens(args, tokens=ids, trainable=False, text=TOOL_TEXT)
        sample.tool_called = True
        _count(args, "upstream_tool_calls")
    room = limit - sample.response_length
    if room <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    await _model_turn(args, state, sample, sampling_params, room, final=True)
    return sample


async def generate_removing_odd(args, sample: Sample, sampling_params: dict) -> Sample:
    """`generate_multi_turn`, then upstream's way to keep a sample out of the loss (its coding agent's, and its
    --rollout-sample-filter-path's): `sample.remove_sample = True`, here on every odd-indexed sample."""
    sample = await generate_multi_turn(args, sample, sampling_params)
    sample.remove_sample = sample.index % 2 == 1
    return sample


async def generate_turns_until_aborted(args, sample: Sample, sampling_params: dict) -> Sample:
    """One token per model turn, `GenerateState.aborted` checked before each, as upstream's multi-turn generates
    check it: once the step aborts, the sample goes back ABORTED without another request (marked
    `stopped_between_turns`), to be resumed from its tokens."""
    from slime.rollout.sglang_rollout import GenerateState

    state = GenerateState(args)
    sample.status = Sample.Status.PENDING
    while sample.status is Sample.Status.PENDING:
        if state.aborted:
            sample.stopped_between_turns = True
            sample.status = Sample.Status.ABORTED
            break
        if sample.response_length >= sampling_params["max_new_tokens"]:
            sample.status = Sample.Status.TRUNCATED
            break
        await _model_turn(args, state, sample, sampling_params, 1, final=False)  # stop / abort set the status
    return sample


async def generate_fanout(args, sample: Sample, sampling_params: dict) -> list[Sample]:
    """Upstream's multi_agent shape: one rollout made into several training samples (copies of the given one,
    each generated, sharing its `rollout_id` so that the loss averages them as one rollout), the first rewarded by
    the plugin itself."""
    import copy

    copies = [copy.deepcopy(sample) for _ in range(2)]
    for c in copies:
        c.rollout_id = sample.index
        await generate_with_state(args, c, sampling_params)
        if c.status is Sample.Status.ABORTED:  # the step stopped: the whole fan-out is generated again
            return copies
    copies[0].reward = await dapo_reward(args, copies[0])
    return copies


async def dapo_reward(args, sample: Sample, **kwargs) -> float:
    """`--custom-rm-path` scoring with upstream's `math_dapo_utils.compute_score` (+1 / -1)."""
    from slime.rollout.rm_hub.math_dapo_utils import compute_score
    from slime.tasks.subtract_chain import normalize_response

    _count(args, "upstream_rewards")
    return compute_score(f"Answer: {normalize_response(sample.response)}", str(sample.label))["score"]


def rewards_differ(args, samples: list[Sample]) -> bool:
    """`--dynamic-sampling-filter-path` returning a plain bool (upstream reads it as DynamicFilterOutput(keep))."""
    return len({s.get_reward_value(args) for s in samples}) > 1


def longest_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """`--buffer-filter-path`, upstream's 4-argument signature: pops the groups it hands out from `buffer`."""
    buffer.sort(key=lambda g: -max(s.response_length for s in g))
    chosen = buffer[:num_samples]
    del buffer[:num_samples]
    return chosen


def generate_rollout_with_plugins(args, rollout_id: int, data_source, evaluation: bool = False):
    """`--rollout-function-path` in upstream's shape (its generate_and_rm): each sample through
    `--custom-generate-function-path` with `GenerateState.sampling_params`, rewarded with `async_rm` unless the
    generate rewarded it, groups kept by `--dynamic-sampling-filter-path`; the counts the plugins kept on args are
    reported as metrics."""
    from slime.rollout.sglang_rollout import GenerateState
    from slime.utils.misc import load_function

    generate_fn = load_function(args.custom_generate_function_path)
    keep = load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
    groups = data_source.eval_groups if evaluation else data_source.get_samples(args.rollout_batch_size)

    async def one(s: Sample):
        out = await generate_fn(args, s, dict(GenerateState(args).sampling_params))
        for x in out if isinstance(out, list) else [out]:
            if x.reward is None:
                x.reward = await async_rm(args, x)
        return out

    async def run():
        return await asyncio.gather(*(asyncio.gather(*(one(s) for s in g)) for g in groups))

    groups = [[x for out in g for x in (out if isinstance(out, list) else [out])] for g in asyncio.run(run())]
    if evaluation:
        samples = [s for g in groups for s in g]
        return RolloutFnEvalOutput(data={"upstream_eval": {"rewards": [s.reward for s in samples],
                                                           "truncated": [False] * len(samples), "samples": samples}})
    kept = [g for g in groups if keep is None or keep(args, g)]
    return RolloutFnTrainOutput(samples=kept, metrics={
        "upstream/generate_calls": args.upstream_generate_calls, "upstream/rewards": args.upstream_rewards,
        "upstream/samples": sum(len(g) for g in kept)})
