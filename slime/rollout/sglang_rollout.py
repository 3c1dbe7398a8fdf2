"""APRIL: the default rollout function (`--rollout-function-path`), with upstream slime's signature.

    generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutOutput

`data_source` is the RolloutManager's `RolloutContext` (slime/rollout/base_types.py). One training call is
one APRIL step (slime/rollout/step.py) against the engines behind the router, fed by `--rollout-mode`'s supply
(chunked over-sampling or a pool) until `--rollout-batch-size` groups are accepted. While it runs, the engine
watchdog names a dead or frozen engine: the step stops as at its target (finished groups kept, the rest
parked), then raises `RolloutEngineFaultError` naming it (`RolloutError` for any other failure).
`evaluation=True` generates `data_source.eval_groups` with the eval sampling flags (slime/rollout/eval_rollout.py).
train_async.py calls `run_rollout_step` with `StepHooks` (its version gate, a halt event, a shared session).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from tqdm import tqdm

from slime.rollout.base_types import RolloutContext, RolloutOutput
from slime.rollout.filter_hub import group_filter
from slime.rollout.generate_state import GenerateState
from slime.rollout.group_outcome import TargetPlacement
from slime.rollout.rm_hub import reward_group, reward_timeout
from slime.rollout.rollout_metrics import EngineMonitors, step_metrics
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.step import UNLIMITED_REWARD_SETTLE_S, StepIO, run_step
from slime.rollout.step_record import RolloutEngineFaultError, RolloutError, StepConfig, step_error
from slime.rollout.step_supply import ChunkedSupply, PoolSupply
from slime.rollout.version_gate import GatedRequester
from slime.utils.misc import run_sync
from slime.utils.plugin_args import run_flags
from slime.utils.types import expand_fanout

SESSION_EXTRA_CONNECTIONS = 32


@dataclass
class StepHooks:
    """What only train_async.py (and tools keeping connections open) pass to a step."""

    session: Any = None  # an aiohttp session on the caller's loop, reused across steps (None: the step opens one)
    gate: Any = None  # a VersionGate every request passes (the caller pauses the step for a weight update there)
    halt: asyncio.Event | None = None  # once set: stop as at the target, park, keep accepted groups ready
    on_io: Callable[[StepIO], None] | None = None  # called with the step's StepIO (stream mode counts its tokens)


def generate_rollout(args, rollout_id: int, data_source: RolloutContext, evaluation: bool = False) -> RolloutOutput:
    return run_sync(generate_rollout_async(args, rollout_id, data_source, evaluation))


async def generate_rollout_async(args, rollout_id: int, data_source: RolloutContext, evaluation: bool = False,
                                 hooks: StepHooks | None = None) -> RolloutOutput:
    args = run_flags(args)  # called with the plugins' view of the flags: the step reads the validated ones
    if evaluation:
        from slime.rollout.eval_rollout import generate_eval

        return await generate_eval(args, rollout_id, data_source)
    return await run_rollout_step(args, rollout_id, data_source, default_supply(args, data_source), None, hooks)


def default_supply(args, ctx: RolloutContext) -> ChunkedSupply | PoolSupply:
    """`--rollout-mode`'s supply: chunked over-sampling (with top-ups under --partial-rollout) or a pool."""
    if args.rollout_mode == "pool":  # --admission: the run's controller (ctx.admission) learns across steps
        return PoolSupply(args.rollout_pool_size, admission=ctx.admission)
    if args.rollout_mode != "chunked":
        raise ValueError(f"--rollout-mode {args.rollout_mode!r}: a single step is chunked or pool (stream runs in "
                         "train_async.py)")
    auto = args.over_sampling_batch_size == "auto"
    if auto and ctx.over_sampling is None:
        raise ValueError("--over-sampling-batch-size auto: the RolloutContext has no over_sampling planner (the "
                         "RolloutManager's lives across steps; others pass OverSamplingPlanner.from_args(args))")
    return ChunkedSupply(None if auto else args.over_sampling_batch_size, args.sglang_server_concurrency,
                         top_ups=args.partial_rollout, planner=ctx.over_sampling if auto else None)


async def run_rollout_step(args, rollout_id: int, ctx: RolloutContext, supply, placement=None,
                           hooks: StepHooks | None = None) -> RolloutOutput:
    """One step against the real engines: `supply` feeds them, `placement` (default: `--rollout-batch-size` groups
    toward the target) takes the accepted groups; raises RolloutError / RolloutEngineFaultError, nothing lost."""
    hooks = hooks or StepHooks()
    gate, bar = hooks.gate, None
    if ctx.cap is None:
        raise ValueError("the RolloutContext has no staleness cap (the RolloutManager passes the run's one cap)")
    if placement is None:  # groups accepted toward the target; off when stderr is not a terminal (logs stay clean)
        bar = tqdm(total=args.rollout_batch_size, desc=f"rollout {rollout_id}", unit="group", leave=False, disable=None)
        placement = TargetPlacement(int(args.rollout_batch_size), on_accept=lambda: bar.update(1))
    urls = await asyncio.to_thread(ctx.engines.worker_urls)
    version = int(gate.train_version if gate is not None else ctx.policy_version)
    config = StepConfig(
        rollout_id=rollout_id, n=int(args.n_samples_per_prompt), partial=args.partial_rollout, cap=ctx.cap,
        policy_version=version, train_version=(lambda: gate.train_version) if gate is not None else (lambda: version),
        rpc_timeout=args.rollout_rpc_timeout, abort_timeout=args.rollout_abort_timeout,
        reward_settle_s=(reward_timeout(args) or UNLIMITED_REWARD_SETTLE_S) + 30.0, num_engines=max(1, len(urls)))
    supply.prepare(config.num_engines)
    shared = hooks.session
    async with contextlib.nullcontext(shared) if shared is not None else aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=supply.in_flight_cap + SESSION_EXTRA_CONNECTIONS)) as session:
        requester = SampleRequester(args, session, ctx.engines.router_url, sampling_params_from_args(args), rollout_id,
                                    int(ctx.policy_version), agent=ctx.agent)
        requester.timeline = []  # requests in flight over the step (the trace's occupancy)
        generate = GatedRequester(requester, gate, ctx.cap).generate if gate is not None else requester.generate
        async with EngineMonitors(args, ctx.engines, session, urls, bar) as monitors:
            # a failed request asks first whether the router or an engine died (the watchdog names it)
            io = StepIO(buffer=ctx.buffer, data_source=ctx.data_source, engines=ctx.engines, requester=requester,
                        generate=monitors.watchdog.explaining(generate),
                        reward=lambda samples: reward_group(args, expand_fanout(samples)),
                        filter=group_filter(args), session=session, watchdog=monitors.watchdog)
            if hooks.on_io is not None:
                hooks.on_io(io)
            record = await run_step(io, config, supply, placement, halt=hooks.halt)
    error = step_error(record)
    if record.halted and error is None:  # stopped for a checkpoint: everything is in the buffer now
        return RolloutOutput(groups=[], metrics={"rollout/halted": 1.0})
    if error is not None:
        raise error
    metrics = step_metrics(args, record, requester, monitors.metrics)
    metrics.update(supply.metrics())  # the over-sampling prediction for this step's size, then learn from it
    await supply.after_step(record, ctx.engines)
    return RolloutOutput(groups=record.accepted, metrics=metrics, dropped=dict(record.rejected))


__all__ = ["GenerateState", "RolloutEngineFaultError", "RolloutError", "StepHooks", "default_supply",
           "generate_rollout", "generate_rollout_async", "run_rollout_step", "run_sync"]
