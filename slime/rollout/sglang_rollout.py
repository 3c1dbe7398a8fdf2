"""APRIL: the default rollout function (`--rollout-function-path`), with upstream slime's signature.

    generate_rollout(args, rollout_id, data_source, evaluation=False) -> RolloutOutput

`data_source` is the RolloutManager's `RolloutContext` (slime/rollout/base_types.py). One training call is
one APRIL step (slime/rollout/step.py) against the engines behind the router:

- `--rollout-mode chunked`: `--over-sampling-batch-size` groups at a time (a fixed size, or `auto`'s
  planner), at most `--sglang-server-concurrency` x engines requests in flight, topped up with
  `--partial-rollout`; `--rollout-mode pool`: `--rollout-pool-size` requests always in flight;
- ready groups (finished after the last step's target) count first; the step stops once
  `--rollout-batch-size` groups are accepted, aborts, drains, parks (or drops) the unfinished groups and
  keeps the groups finished after the target ready for the next step;
- an engine watchdog runs during the step: if an engine dies or freezes (or a request fails), the step stops
  the same way, keeps every finished group in the buffer and parks the rest (the samples on the failed engine
  at the tokens it last returned), then raises `RolloutEngineFaultError` naming the engine (`RolloutError`
  for any other failure).

`evaluation=True` generates `data_source.eval_groups` with the eval sampling flags (slime/rollout/eval_rollout.py).
train_async.py calls `run_rollout_step` with `StepHooks` (its version gate, a halt event, a shared session).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from tqdm import tqdm

from slime.backends.sglang_utils.watchdog import EngineWatchdog
from slime.rollout.base_types import RolloutContext, RolloutOutput
from slime.rollout.filter_hub import load_dynamic_filter
from slime.rollout.generate_state import GenerateState
from slime.rollout.group_outcome import TargetPlacement
from slime.rollout.over_sampling import OverSamplingPlanner, over_sampling_from_args
from slime.rollout.rm_hub import reward_group, reward_timeout
from slime.rollout.rollout_metrics import OccupancySampler, step_metrics
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.staleness import StalenessCap
from slime.rollout.step import RolloutEngineFaultError, RolloutError, StepIO, engine_fault, run_step, step_error
from slime.rollout.step_end import UNLIMITED_REWARD_SETTLE_S
from slime.rollout.step_state import StepState
from slime.rollout.step_supply import ChunkedSupply, PoolSupply
from slime.rollout.version_gate import GatedRequester
from slime.utils.plugin_args import plugin_args, run_flags
from slime.utils.types import expand_fanout

logger = logging.getLogger(__name__)

SESSION_EXTRA_CONNECTIONS = 32


@dataclass
class StepHooks:
    """What only train_async.py (and tools keeping connections open) pass to a step.

    `session`: an aiohttp session on the caller's loop, reused across steps (its connector must allow the
    in-flight cap; None: the step opens its own); `gate`: a `VersionGate` every request passes, so the caller
    can pause the step for an in-flight weight update (staleness and version metrics then use
    `gate.train_version`, the version that will train the batch); `halt`: once set the step stops as at its
    target, parks its unfinished groups, keeps its accepted ones ready and returns no groups; `on_io(io)`:
    called once the step's `StepIO` is open (stream mode counts its requester's tokens)."""

    session: Any = None
    gate: Any = None
    halt: asyncio.Event | None = None
    on_io: Callable[[StepIO], None] | None = None


def run_sync(coro):
    """Run `coro` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        return pool.submit(asyncio.run, coro).result()


def generate_rollout(args, rollout_id: int, data_source: RolloutContext, evaluation: bool = False) -> RolloutOutput:
    args = run_flags(args)  # called with the plugins' view of the flags: the step reads the validated ones
    return run_sync(generate_rollout_async(args, rollout_id, data_source, evaluation))


async def generate_rollout_async(args, rollout_id: int, data_source: RolloutContext, evaluation: bool = False,
                                 hooks: StepHooks | None = None) -> RolloutOutput:
    args = run_flags(args)
    if evaluation:
        from slime.rollout.eval_rollout import generate_eval

        return await generate_eval(args, rollout_id, data_source)
    return await run_rollout_step(args, rollout_id, data_source, default_supply(args, data_source), None, hooks)


def default_supply(args, ctx: RolloutContext) -> ChunkedSupply | PoolSupply:
    """`--rollout-mode`'s supply: chunked over-sampling (with top-ups under --partial-rollout) or a pool."""
    if args.rollout_mode == "pool":
        return PoolSupply(args.rollout_pool_size)
    if args.rollout_mode != "chunked":
        raise ValueError(f"--rollout-mode {args.rollout_mode!r}: a single step is chunked or pool (stream runs in "
                         "train_async.py)")
    over_sampling = ctx.over_sampling if ctx.over_sampling is not None else over_sampling_from_args(args)
    if isinstance(over_sampling, OverSamplingPlanner) and ctx.over_sampling is None:
        raise ValueError("--over-sampling-batch-size auto: the RolloutContext has no over_sampling planner (the "
                         "RolloutManager makes one that lives across steps; other callers pass "
                         "over_sampling_from_args(args))")
    return ChunkedSupply(over_sampling, args.sglang_server_concurrency, top_ups=args.partial_rollout)


def new_state(args, rollout_id: int, ctx: RolloutContext, target: int | None, gate=None) -> StepState:
    version = int(gate.train_version if gate is not None else ctx.policy_version)
    return StepState(
        rollout_id=rollout_id, target=target,
        n=int(args.n_samples_per_prompt), partial=args.partial_rollout, cap=StalenessCap.from_args(args),
        policy_version=version, train_version=(lambda: gate.train_version) if gate is not None else (lambda: version),
        rpc_timeout=args.rollout_rpc_timeout, abort_timeout=args.rollout_abort_timeout,
        reward_settle_s=(reward_timeout(args) or UNLIMITED_REWARD_SETTLE_S) + 30.0)


def group_filter(args, state: StepState) -> Callable[[list], str | None] | None:
    """`--dynamic-sampling-filter-path` as reason-or-None; a rejected group that asked to be kept when the step
    runs short (`keep_when_insufficient`) is kept while the step's candidates are no more than its target."""
    path = args.dynamic_sampling_filter_path
    if not path:
        return None
    fn, view = load_dynamic_filter(path), plugin_args(args)

    def reason(samples: list) -> str | None:
        out = fn(view, samples)
        candidates = len(state.accepted) + len(state.failed) + len(state.open_groups())
        return (out.reason or "filtered") if out.drops(candidates, state.target) else None

    return reason


async def run_rollout_step(args, rollout_id: int, ctx: RolloutContext, supply, placement=None,
                           hooks: StepHooks | None = None) -> RolloutOutput:
    """One step against the real engines: `supply` feeds them, `placement` (default: `--rollout-batch-size`
    groups toward the target) takes the accepted groups. Raises `RolloutError` / `RolloutEngineFaultError`
    after keeping what finished."""
    hooks = hooks or StepHooks()
    bar = None
    if placement is None:  # groups accepted toward the target; off when stderr is not a terminal (logs stay clean)
        bar = tqdm(total=args.rollout_batch_size, desc=f"rollout {rollout_id}", unit="group", leave=False, disable=None)
        placement = TargetPlacement(int(args.rollout_batch_size), on_accept=lambda: bar.update(1))
    state = new_state(args, rollout_id, ctx, placement.target, hooks.gate)
    urls = await asyncio.to_thread(ctx.engines.worker_urls)
    state.num_engines = max(1, len(urls))
    supply.prepare(state)
    shared = hooks.session
    async with contextlib.nullcontext(shared) if shared is not None else aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=state.in_flight_cap + SESSION_EXTRA_CONNECTIONS)) as session:
        requester = SampleRequester(args, session, ctx.engines.router_url, sampling_params_from_args(args), rollout_id,
                                    int(ctx.policy_version), agent=ctx.agent)
        requester.timeline = []  # requests in flight over the step (the trace's occupancy)
        generate = (GatedRequester(requester, hooks.gate, state.cap).generate if hooks.gate is not None
                    else requester.generate)
        io = StepIO(buffer=ctx.buffer, data_source=ctx.data_source, engines=ctx.engines, requester=requester,
                    generate=generate, reward=lambda samples: reward_group(args, expand_fanout(samples)), filter=group_filter(args, state),
                    session=session)
        io.monitors = EngineMonitors(args, ctx.engines, session, urls, state, requester, bar)
        io.generate = io.monitors.watchdog.explaining(io.generate)  # a failed request: did the router or an engine die?
        if hooks.on_io is not None:
            hooks.on_io(io)
        await run_step(state, io, supply, placement, halt=hooks.halt)
    error = step_error(state)
    if state.halted and error is None:  # stopped for a checkpoint: everything is in the buffer now
        return RolloutOutput(groups=[], metrics={"rollout/halted": 1.0})
    if error is not None:
        raise error
    metrics = step_metrics(args, state, requester, io.monitor_metrics or {})
    metrics.update(supply.metrics())  # the over-sampling prediction for this step's size, then learn from it
    await supply.after_step(state, ctx.engines)
    return RolloutOutput(groups=state.accepted, metrics=metrics, dropped=dict(state.rejected))


class EngineMonitors:
    """Watch the real engines while a step runs: the watchdog (a dead or frozen engine stops the step, named)
    and the occupancy sampler (`/get_load`); `stop` returns the occupancy metrics."""

    def __init__(self, args, engines, session, urls: list[str], state: StepState, requester, bar):
        self.bar = bar
        self.occupancy = OccupancySampler(session, urls)
        self.occupancy.start()
        self.watchdog = EngineWatchdog(args, engines, session,
                                       on_fault=lambda f: engine_fault(state, f, requester.in_flight)).start()

    async def stop(self, state: StepState) -> dict[str, float]:
        if self.bar is not None:
            self.bar.close()
        if state.errors and not state.faults:
            await self.watchdog.check_once()  # did a request fail because an engine died?
        await self.watchdog.stop()
        return await self.occupancy.stop()


__all__ = ["GenerateState", "RolloutEngineFaultError", "RolloutError", "StepHooks", "default_supply", "generate_rollout",
           "generate_rollout_async", "run_rollout_step", "run_sync"]
