"""Evaluation rollout: generate every eval group with the eval sampling flags (no buffer, no partial rollout)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from slime.backends.sglang_utils.watchdog import EngineWatchdog
from slime.rollout.base_types import RolloutOutput
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.step_record import StepClock
from slime.utils.types import Sample, Status, expand_fanout

logger = logging.getLogger(__name__)


def eval_sets(given: Any) -> dict[str, list[list[Sample]]]:
    if isinstance(given, dict):
        return given
    if given is None:
        raise ValueError("evaluation rollout: data_source.eval_groups is empty (the RolloutManager passes the "
                         "--eval-prompt-data sets)")
    return {"eval": list(given)}


async def generate_eval(args, rollout_id: int, groups, engines, version: int, agent=None) -> RolloutOutput:
    """`groups` generated on `engines` (serving `version`) with the eval flags, and rewarded."""
    from slime.rollout.rm_hub import reward_group

    sets = eval_sets(groups)
    urls = await asyncio.to_thread(engines.worker_urls)
    concurrency = args.sglang_server_concurrency * max(1, len(urls))
    sem = asyncio.Semaphore(concurrency)
    max_len = args.eval_max_response_len
    clock = StepClock()
    metrics: dict[str, float] = {}
    all_groups: list[list[Sample]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8)) as session, \
            EngineWatchdog(args, engines, session) as watchdog:  # a dead / frozen engine: EngineFaultError
        req = SampleRequester(args, session, engines.router_url, sampling_params_from_args(args, evaluation=True),
                              rollout_id, int(version), max_response_len=max_len, evaluation=True, agent=agent)

        async def one_group(group: list[Sample]) -> None:
            async def one(s: Sample) -> None:
                async with sem:
                    await req.generate(s, None)

            await asyncio.gather(*(one(s) for s in group if not s.status.is_finished))
            await reward_group(args, expand_fanout(group))

        for name, groups in sets.items():
            await watchdog.guard(asyncio.gather(*(one_group(g) for g in groups)))
            samples = [s for g in groups for s in g]
            ok = [float(s.reward) for s in samples if s.status != Status.FAILED and isinstance(s.reward, (int, float))]
            n = max(1, len(samples))
            metrics[f"eval/{name}/reward_mean"] = sum(ok) / len(ok) if ok else 0.0
            metrics[f"eval/{name}/samples"] = float(len(samples))
            metrics[f"eval/{name}/failed_samples"] = float(sum(s.status == Status.FAILED for s in samples))
            metrics[f"eval/{name}/truncated_ratio"] = sum(s.status == Status.TRUNCATED for s in samples) / n
            metrics[f"eval/{name}/response_len_mean"] = sum(s.response_length for s in samples) / n
            all_groups.extend(groups)
        metrics["eval/time_s"] = clock.now()
        metrics["eval/tokens_per_s"] = req.new_tokens / max(clock.now(), 1e-9)
    return RolloutOutput(groups=all_groups, metrics=metrics)
