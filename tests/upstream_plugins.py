"""Plugins written to upstream slime's documented contracts (docs/en/get_started/customization.md of THUDM/slime),
not ours: they import what upstream's plugins import, post to the router named by `args`, grow samples by setting
their fields and return upstream's output types. tests/test_upstream_compat.py runs them through train.py."""

from __future__ import annotations

import asyncio

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.rm_hub import async_rm
from slime.utils.http_utils import post
from slime.utils.types import Sample


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """`--custom-generate-function-path`: `async def custom_generate(args, sample, sampling_params) -> Sample`.
    Like upstream's built-in generate: continues a partial sample from its tokens; max_new_tokens is the whole
    budget, so what the sample already has is taken off."""
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
