"""The run's rollout: one object that lives as long as the run, and its three verbs.

    rollout = Rollout(RolloutConfig.from_args(args), buffer, data_source, link, planner=None)
    out = await rollout.step(rollout_id)               # one APRIL / pool step, or a stream segment: run_step inside
    async with rollout.updating_weights(version) as flush_cache:
        push(flush_cache)                              # paused per --pause-mode around the push, then resumed
    out = await rollout.evaluate(rollout_id, groups)

It owns what lives across steps: the buffer handle, the staleness cap, the admission controller, the over-sampling
planner, the version gate and the engines' pause protocol (docs/architecture.md). The `link` is the real engines
(`EngineLink`) or the simulator's (`SimLink`).

A weight update: without a gate (train.py) the engines are idle and the caller pushes. With one (train_async.py),
by `--pause-mode`: abort (every request of ours aborted, resumed from its tokens after the push); retract /
in_place (no new request passes the gate, the engines pause holding ours, KV freed / kept; after the push the
requests over --max-staleness are aborted by rid, so the cap applies when they resume). `flush_cache` is the one
rule: flush the prefix cache unless `--reuse-stale-kv` or in_place (SGLang refuses a flush while it holds
requests)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from slime.rollout.admission import AdmissionControl
from slime.rollout.base_types import RolloutOutput
from slime.rollout.buffer import RPC_TIMEOUT_S, call_maybe_remote, call_sync, take_groups
from slime.rollout.staleness import StalenessCap
from slime.rollout.step import UNLIMITED_REWARD_SETTLE_S, StepIO, run_step
from slime.rollout.step_record import StepConfig, StepRecord, step_error
from slime.rollout.step_supply import ChunkedSupply, PoolSupply
from slime.rollout.version_gate import GatedRequester, VersionGate
from slime.utils.ledger import DROPPED, FINISHED, group_id, is_group_finished
from slime.utils.misc import run_sync
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass(frozen=True)
class RolloutConfig:
    """What the rollout reads of the flags (`from_args`; the simulator makes one from its SimConfig)."""

    mode: str  # --rollout-mode: chunked | pool | stream
    batch_size: int  # --rollout-batch-size
    n: int  # --n-samples-per-prompt
    over_sampling: int | str  # --over-sampling-batch-size (chunked; "auto": the planner's)
    partial: bool  # --partial-rollout
    pool_size: int  # --rollout-pool-size
    admission: str  # --admission
    concurrency_per_engine: int  # --sglang-server-concurrency
    cap: StalenessCap  # --max-staleness, --staleness-policy, the length guard
    pause_mode: str  # --pause-mode (train_async.py; train.py: abort)
    reuse_stale_kv: bool
    rpc_timeout: float  # --rollout-rpc-timeout
    abort_timeout: float  # --rollout-abort-timeout
    reward_settle_s: float  # how long a step's end waits for rewards still running after its drain
    top_ups: bool = True  # chunked with --partial-rollout: top up as requests finish (False: whole chunks, the paper's)

    @classmethod
    def from_args(cls, args) -> "RolloutConfig":
        from slime.rollout.rm_hub import reward_timeout

        return cls(args.rollout_mode, args.rollout_batch_size, args.n_samples_per_prompt, args.over_sampling_batch_size,
                   args.partial_rollout, args.rollout_pool_size, args.admission, args.sglang_server_concurrency,
                   StalenessCap.from_args(args), args.pause_mode, args.reuse_stale_kv,
                   args.rollout_rpc_timeout, args.rollout_abort_timeout,
                   (reward_timeout(args) or UNLIMITED_REWARD_SETTLE_S) + 30.0)


class Rollout:
    def __init__(self, config: RolloutConfig, buffer, data_source, link, planner=None, policy_version: int = 0):
        if config.pause_mode not in PAUSE_MODES:
            raise ValueError(f"--pause-mode {config.pause_mode!r} is not one of {PAUSE_MODES}")
        if (config.over_sampling == "auto") != (planner is not None):
            raise ValueError("--over-sampling-batch-size auto needs its planner (OverSamplingPlanner.from_args(args)), "
                             "and a fixed size takes none")
        self.config, self.buffer, self.data_source, self.link = config, buffer, data_source, link
        self.engines = link.engines if link is not None else None
        self.planner = planner  # --over-sampling-batch-size auto (slime/rollout/simulator/planner.py)
        self.cap = config.cap
        self.admission = None if config.mode == "chunked" else AdmissionControl(
            config.admission, config.pool_size, config.n, config.batch_size * config.n)
        self.version = int(policy_version)  # the trainer's policy version (train.py's steps train at it)
        self.gate: VersionGate | None = None  # train_async.py's (run_ahead)
        self.production = None  # train_async.py's producer (rebalances backpressure when a hold ends)
        self.pausable = True  # False: a custom rollout function's steps, waited for instead (abort only)
        self.io: StepIO | None = None  # the running step's
        self.record: StepRecord | None = None  # the last step's
        self.tokens = 0  # new tokens of the steps that ended
        self.update_pause_s = 0.0

    # ---- state ----------------------------------------------------------------------------
    @property
    def served_version(self) -> int:
        """The version the engines serve (train.py: the policy version; train_async.py: the gate's)."""
        return self.gate.version if self.gate is not None else self.version

    @property
    def flush_cache(self) -> bool:
        """Whether a push flushes the engines' prefix cache (see the module docstring)."""
        return not self.config.reuse_stale_kv and self.pause_mode != "in_place"

    @property
    def pause_mode(self) -> str:
        return self.config.pause_mode if self.gate is not None and self.pausable else "abort"

    def new_tokens(self) -> int:
        """New tokens over the run so far, the running step's included."""
        return self.tokens + (self.io.requester.new_tokens if self.io is not None else 0)

    def requests(self, requester):
        """A step's `generate(sample, stop)`: the requester's request loop, through the gate if there is one (each
        request waits while it is held, and the cap applies when a sample resumes across an update)."""
        return GatedRequester(requester, self.gate, self.cap).generate if self.gate is not None else requester.generate

    def supply(self) -> ChunkedSupply | PoolSupply:
        """`--rollout-mode`'s: chunked over-sampling (top-ups under --partial-rollout), a pool, or stream mode's pool,
        gated (no new group while the gate is held). Either takes parked groups first (`take_groups`)."""
        c = self.config
        if c.mode == "chunked":  # auto: the planner's choice for this step
            size = self.planner.size() if self.planner is not None else int(c.over_sampling)
            return ChunkedSupply(size, c.concurrency_per_engine, top_ups=c.partial and c.top_ups)
        return PoolSupply(c.pool_size, gate=self.gate if c.mode == "stream" else None, admission=self.admission)

    # ---- the verbs ----------------------------------------------------------------------------
    async def step(self, rollout_id: int, placement=None, halt=None) -> RolloutOutput:
        """One step toward `--rollout-batch-size` accepted groups (or into a stream's `placement`). Raises after
        its commit (nothing lost); a halted one returns no groups and `rollout/halted` 1."""
        c, gate, supply = self.config, self.gate, self.supply()
        version = gate.train_version if gate is not None else self.version
        urls = await self.link.worker_urls()
        config = StepConfig(rollout_id=rollout_id, n=c.n, partial=c.partial, cap=self.cap, policy_version=version,
                            train_version=(lambda: gate.train_version) if gate is not None else (lambda: version),
                            rpc_timeout=c.rpc_timeout, abort_timeout=c.abort_timeout, reward_settle_s=c.reward_settle_s,
                            num_engines=max(1, len(urls)))
        supply.prepare(config.num_engines)
        async with self.link.open_step(self, rollout_id, urls, supply.in_flight_cap) as io:
            self.io = io
            if self.admission is not None:
                self.admission.watch(io)  # --admission auto: this step's load reports
            placement = placement or TargetPlacement(c.batch_size, on_accept=io.progress)
            try:
                record = await run_step(io, config, supply, placement, halt)
            finally:
                self.tokens, self.io = self.tokens + io.requester.new_tokens, None
        self.record = record
        error = step_error(record)
        if record.halted and error is None:
            return RolloutOutput(groups=[], metrics={"rollout/halted": 1.0})
        if error is not None:
            raise error
        metrics = self.link.step_metrics(record, io)
        if self.planner is not None:  # this step's over-sampling prediction, then the planner learns from the step
            metrics.update(self.planner.metrics())
            await self.planner.after_step(record, self.engines)
        if self.admission is not None:  # auto: the step's tokens/s judges its climb
            metrics.update(self.admission.metrics())
            self.admission.step_ended(record)
        return RolloutOutput(groups=record.accepted, metrics=metrics, dropped=dict(record.rejected))

    @contextlib.asynccontextmanager
    async def updating_weights(self, version: int):
        """The caller pushes `version` inside (given `flush_cache`), paused per --pause-mode (module docstring)."""
        gate, engines, session = self.gate, self.engines, self.link.session
        t0 = asyncio.get_running_loop().time()
        if gate is None:  # train.py: nothing of ours runs between steps
            yield self.flush_cache
            self.version = int(version)
        elif self.pause_mode == "abort":
            await self.hold("update")
            try:
                yield self.flush_cache
            finally:
                gate.set_version(version)
                await self.release("update")  # backpressure is decided for the new version before the gate reopens
        else:
            gate.begin_update(version)  # replies may carry `version` from now on
            await gate.hold("update", engines, session, drain=False)  # nothing new is sent
            await engines.pause(self.pause_mode, session)
            try:
                yield self.flush_cache
            finally:
                gate.end_update()
                await self.production.rebalance()  # may add a "lag" hold while the gate is still closed
                floor = self.cap.restart_floor(gate.train_version)
                if floor is not None:
                    await gate.abort_requests(gate.stale_requests(floor), engines, session)
                await engines.continue_generation(session)
                gate.release("update")
        self.update_pause_s = asyncio.get_running_loop().time() - t0

    async def evaluate(self, rollout_id: int, groups) -> RolloutOutput:
        """`groups` (a list, or a dict by set name) generated on the served weights and rewarded; no buffer."""
        return await self.link.evaluate(rollout_id, groups, self.served_version)

    # ---- train_async.py: steps under a version gate ----------------------------------------------------
    def run_ahead(self, production, pausable: bool = True) -> VersionGate:
        """From now on every request passes a version gate, so weights can change under a running step; `pausable`
        False: a custom rollout function's steps, which an update waits for."""
        self.gate = VersionGate(self.version, train_version=self.version)
        self.production, self.pausable = production, pausable
        if self.pause_mode == "in_place" and self.link.backend == "sglang":
            self.gate.span_lag = 1  # SGLang appends the token in flight at an in-place pause after the update
        logger.info("the rollout runs ahead of the trainer: weight updates in flight with --pause-mode %s",
                    self.pause_mode)
        return self.gate

    async def hold(self, reason: str) -> None:
        """Nothing of ours runs on the engines until `release(reason)` (an eval shares them, an update by abort)."""
        if not self.pausable:  # a custom step cannot be paused: wait until it ends (nothing passes the gate)
            await self.production.step_lock.acquire()
        await self.gate.hold(reason, self.engines, self.link.session, timeout=self.config.abort_timeout)

    async def release(self, reason: str) -> None:
        await self.production.rebalance()  # may add a "lag" hold while the gate is still closed
        self.gate.release(reason)
        if not self.pausable:
            self.production.step_lock.release()

    def context(self, eval_groups=None, halt=None) -> "RolloutContext":
        """What a rollout function gets as upstream's `data_source` (`halt`: train.py's stop request)."""
        return RolloutContext(self, eval_groups, halt)


class TargetPlacement:
    """train.py's step: ready groups from the last step count first, then accepted groups until `target`."""

    def __init__(self, target: int, on_accept: Callable[[], None] | None = None):
        self.target = target
        self.on_accept = on_accept  # e.g. a progress bar's update

    async def take_ready(self, rec: StepRecord, io) -> None:
        if io.buffer is None:
            return
        c = rec.config
        ready = await call_maybe_remote(io.buffer, "take_ready", self.target, timeout=c.rpc_timeout)
        rec.ready_in = list(ready)
        # finished at an older policy: the cap as before training (restart drops the group, mask masks, keep keeps)
        kept, stale, counts = c.cap.before_training(ready, c.train_version())
        rec.staleness.update(counts)
        for g in stale:
            rec.rejected[group_id(g)] = "stale_ready"
        for g in kept:
            self.accept(rec, g)

    def accept(self, rec: StepRecord, group: list) -> None:
        rec.accepted.append(group)
        if self.on_accept is not None:
            self.on_accept()


@dataclass
class RolloutContext:
    """What a rollout function (`--rollout-function-path`) gets as upstream's `data_source`: upstream's interface
    (`get_samples`, `add_samples`, `len`) over the run's `rollout`; `eval_groups` for `evaluation=True`."""

    rollout: Rollout
    eval_groups: list[list[Sample]] | dict[str, list[list[Sample]]] | None = None  # a list, or lists by eval set
    # train.py: the run's stop request (GracefulStop: `is_set()`, an `async wait()` on any loop), the step's `halt`
    halt: Any = None
    # ids handed out by get_samples and not yet handed back or returned (settled after the call)
    issued: set[int] = field(default_factory=set)

    @property
    def policy_version(self) -> int:
        return self.rollout.served_version

    @property
    def buffer(self):
        return None if self.eval_groups is not None else self.rollout.buffer

    def get_samples(self, num: int) -> list[list[Sample]]:
        """`num` groups, parked first (the staleness cap applied), `issued` until returned or handed back."""
        r = self.rollout
        parked, fresh, _ = run_sync(take_groups(self.buffer, r.data_source, num, r.config.n, r.cap, self.policy_version,
                                                RPC_TIMEOUT_S))
        self.issued.update(group_id(g) for g in parked + fresh)
        return parked + fresh

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Hand groups back for a later step: unfinished ones are parked (resumed first), finished ones held ready."""
        unfinished = [g for g in groups if not is_group_finished(g)]
        finished = [g for g in groups if is_group_finished(g)]
        if unfinished and self.buffer is not None:
            call_sync(self.buffer, "park", unfinished)
        if finished and self.buffer is not None:
            call_sync(self.buffer, "mark", [group_id(g) for g in finished], FINISHED)
            call_sync(self.buffer, "hold_ready", finished)
        self.issued.difference_update(group_id(g) for g in groups)

    def __len__(self) -> int:
        return len(self.rollout.data_source)

    def settle_issued(self, returned: list[list[Sample]]) -> dict[int, str]:
        """After a rollout function returned `returned`: those it got from `get_samples` are finished; any other
        group it got and neither returned nor handed back is dropped (it can never come back)."""
        if self.buffer is None:
            return {}
        ids = {group_id(g) for g in returned} & self.issued
        if ids:
            call_sync(self.buffer, "mark", sorted(ids), FINISHED)
        lost = sorted(self.issued - ids)
        if lost:
            call_sync(self.buffer, "mark", lost, DROPPED, "not_returned_by_rollout_function")
        self.issued.clear()
        return {gid: "not_returned_by_rollout_function" for gid in lost}


__all__ = ["PAUSE_MODES", "Rollout", "RolloutConfig", "RolloutContext", "TargetPlacement"]
