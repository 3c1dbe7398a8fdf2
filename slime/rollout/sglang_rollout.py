"""APRIL: the default rollout function (`--rollout-function-path`).

One step (`generate_rollout`):
1. ready groups (finished after last step's target was met) count first;
2. groups are taken from the buffer (parked partials first, FIFO or
   `--buffer-filter-path`; the staleness cap applied) and then fresh from the
   data source, and submitted through the router, one `POST /generate` per
   unfinished sample (`input_ids` = its tokens so far, `max_new_tokens` = the
   budget left). `--rollout-mode chunked` submits `--over-sampling-batch-size`
   groups at a time while (groups in play + accepted) < target, with at most
   `--sglang-server-concurrency` x engines requests in flight;
   `--rollout-mode pool` keeps exactly `--rollout-pool-size` requests in flight,
   topping up from parked then fresh groups (CoPRIS);
3. a group whose members all finished is rewarded in its own task (a slow
   reward never blocks generation or the drain), then filtered
   (`--dynamic-sampling-filter-path`); rejected groups are dropped in the ledger
   with the filter's reason;
4. once `--rollout-batch-size` groups are accepted: abort, drain, park (with
   `--partial-rollout`) or drop the unfinished groups, keep groups finished
   after the target for the next step (slime/rollout/step_end.py).

A group whose every sample failed (its reward raised or timed out, the engine
refused its prompt) has nothing to train on: it is dropped in the ledger with
the failure as its reason and still counts toward the step's target (so a
broken reward cannot make a step draw the whole dataset); a step can therefore
return fewer groups, or none.

An engine watchdog (`slime/backends/sglang_utils/watchdog.py`) runs during
the step. If an engine dies or freezes (or a request fails), the step stops
the same way, keeps every finished group in the buffer and parks (or drops)
the rest, with the samples that were on the failed engine back at the tokens
it last returned, then raises `EngineFaultError` naming the engine and what
the step was doing (`RolloutError` for any other failure).

train_async.py passes `ctx.gate` (weight updates in flight) and `ctx.halt` (stop for a checkpoint);
stream mode (slime/rollout/stream.py) reuses the step with no target and its own `_place_group`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections import Counter

import aiohttp
from tqdm import tqdm

from slime.backends.sglang_utils.http_client import EngineHTTPError, EngineUnreachableError
from slime.backends.sglang_utils.watchdog import EngineFault, EngineFaultError, EngineWatchdog
from slime.rollout.base_types import RolloutContext, RolloutOutput
from slime.rollout.group_outcome import GroupOutcome, StepGroup
from slime.rollout.pool_mode import SamplePool
from slime.rollout.rollout_metrics import OccupancySampler, StepClock, step_metrics
from slime.rollout.sampling_request import SampleRequester, call_maybe_remote, sampling_params_from_args
from slime.rollout.staleness import StalenessCap
from slime.rollout.step_end import StepEnd
from slime.utils.ledger import group_id
from slime.utils.misc import load_function
from slime.utils.types import Sample

logger = logging.getLogger(__name__)



class RolloutError(RuntimeError):
    """A rollout step could not complete; finished groups were kept in the buffer first."""


class RolloutEngineFaultError(RolloutError, EngineFaultError):
    """A rollout step stopped because engines died or froze (`.faults` names them); nothing was lost."""

    def __init__(self, message: str, faults: list[EngineFault]):
        EngineFaultError.__init__(self, message, faults)


def run_sync(coro):
    """Run `coro` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        return pool.submit(asyncio.run, coro).result()


def generate_rollout(args, rollout_id: int, ctx: RolloutContext, evaluation: bool = False) -> RolloutOutput:
    return run_sync(generate_rollout_async(args, rollout_id, ctx, evaluation))


async def generate_rollout_async(args, rollout_id: int, ctx: RolloutContext, evaluation: bool = False) -> RolloutOutput:
    if evaluation:
        from slime.rollout.eval_rollout import generate_eval

        return await generate_eval(args, rollout_id, ctx)
    return await _RolloutStep(args, rollout_id, ctx).run()


class _RolloutStep(GroupOutcome, StepEnd):
    def __init__(self, args, rollout_id: int, ctx: RolloutContext):
        self.args, self.rollout_id, self.ctx = args, rollout_id, ctx
        self.target = int(args.rollout_batch_size)
        self.n = int(args.n_samples_per_prompt)
        self.planner = ctx.over_sampling_planner if args.over_sampling_batch_size == "auto" else None
        if args.over_sampling_batch_size == "auto" and self.planner is None:
            raise ValueError("--over-sampling-batch-size auto: the RolloutContext has no over_sampling_planner "
                             "(the RolloutManager makes one; other callers pass an OverSamplingPlanner)")
        self.chunk = self.planner.size() if self.planner is not None else int(args.over_sampling_batch_size)
        self.mode = args.rollout_mode
        self.partial = args.partial_rollout
        self.gate = ctx.gate
        # the version that will train this step's groups: staleness and version metrics are measured against it
        self.version = int(ctx.gate.train_version if ctx.gate is not None else ctx.policy_version)
        self.halted = False
        self.cap = StalenessCap.from_args(args)
        fpath = args.dynamic_sampling_filter_path
        self.filter = load_function(fpath) if fpath else None
        self.rpc_timeout = args.rollout_rpc_timeout
        self.abort_timeout = args.rollout_abort_timeout
        self.groups: dict[int, StepGroup] = {}
        self.accepted: list[list[Sample]] = []
        self.overflow: list[list[Sample]] = []
        self.rejected: dict[int, str] = {}
        self.failed: list[int] = []  # groups with no trainable sample, counted toward the target
        self.faults: dict[str, EngineFault] = {}
        self.fault_seen = asyncio.Event()  # set at each new fault: an abort waiting on that engine stops waiting
        self.watchdog: EngineWatchdog | None = None
        self.submitted: list[int] = []
        self.resumed: list[int] = []
        self.counts: Counter = Counter()
        self.errors: list[str] = []
        self.tasks: set[asyncio.Task] = set()
        self.reward_tasks: set[asyncio.Task] = set()
        self.progress = asyncio.Event()
        self.stop = asyncio.Event()
        self.fetch_lock = asyncio.Lock()
        self.exhausted = False
        self.clock = StepClock()

    # ---- the step ------------------------------------------------------------------
    async def run(self) -> RolloutOutput:
        urls = await asyncio.to_thread(self.ctx.engines.worker_urls)
        self.num_engines = max(1, len(urls))
        concurrency = self.args.sglang_server_concurrency * self.num_engines
        pool_size = self.args.rollout_pool_size
        limit = pool_size if self.mode == "pool" else concurrency
        shared = self.ctx.http_session
        async with contextlib.nullcontext(shared) if shared is not None else aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=limit + 32)) as session:
            self.requester = SampleRequester(self.args, session, self.ctx.engines.router_url,
                                             sampling_params_from_args(self.args), self.rollout_id,
                                             int(self.ctx.policy_version), gate=self.gate)
            self.requester.timeline = []  # requests in flight over the step (the trace's occupancy)
            occupancy = OccupancySampler(session, urls)
            occupancy.start()
            self.watchdog = EngineWatchdog(self.args, self.ctx.engines, session, on_fault=self._engine_fault).start()
            # groups accepted toward the target; off when stderr is not a terminal (logs stay clean)
            self.bar = tqdm(total=self.target, desc=f"rollout {self.rollout_id}", unit="group", leave=False, disable=None)
            watcher = asyncio.create_task(self._watch_halt()) if self.ctx.halt is not None else None
            try:
                await self._take_ready()
                if self.mode in ("pool", "stream"):
                    await self._run_pool(pool_size)
                elif self.mode == "chunked":
                    await self._run_chunked(asyncio.Semaphore(concurrency), concurrency)
                else:
                    raise ValueError(f"--rollout-mode {self.mode!r} is not one of chunked, pool, stream")
            except Exception as e:  # stop cleanly: drain, keep finished groups, then raise RolloutError
                self._fail(f"{type(e).__name__}: {e}")
            finally:
                self.bar.close()
                if watcher is not None:
                    watcher.cancel()
                await self._stop_and_drain(session)
                if self.errors and not self.faults:
                    await self.watchdog.check_once()  # did a request fail because an engine died?
                await self.watchdog.stop()
                occ = await occupancy.stop()
            await self._settle_rewards()
        await self._commit()
        if self.halted and not self.errors:  # stopped for a checkpoint: everything is in the buffer now
            return RolloutOutput(groups=[], metrics={"rollout/halted": 1.0})
        if self.errors:
            cause = self.errors[0] + (f" (+{len(self.errors) - 1} more)" if len(self.errors) > 1 else "")
            if self.faults:  # name the engine first: the requests' own errors (a 503 from the router) say less
                cause = "; ".join(f.describe() for f in self.faults.values()) + f" (the step saw: {cause})"
            msg = (f"rollout step {self.rollout_id} failed: {cause}; kept {len(self.accepted) + len(self.overflow)} "
                   f"finished groups in the buffer, {self.counts['parked']} parked, {self.counts['discarded']} dropped")
            if self.faults:
                raise RolloutEngineFaultError(msg, list(self.faults.values()))
            raise RolloutError(msg)
        metrics = self._metrics(occ, concurrency if self.mode == "chunked" else pool_size)
        if self.planner is not None:  # the prediction for this step's size, then learn from the step
            metrics.update(self.planner.metrics())
            await self.planner.after_step(self)
        return RolloutOutput(groups=self.accepted, metrics=metrics, dropped=dict(self.rejected))

    def _filled(self) -> bool:
        """The step's target is met: accepted groups plus groups that failed outright (nothing to train)."""
        return len(self.accepted) + len(self.failed) >= self.target

    def _engine_fault(self, fault: EngineFault) -> None:
        self.faults[fault.url] = fault
        self.fault_seen.set()
        self._fail(f"{fault.describe()} while generating rollout step {self.rollout_id} "
                   f"({self.requester.in_flight} requests in flight, {len(self.accepted)}/{self.target} groups accepted)")

    async def _watch_halt(self) -> None:
        await self.ctx.halt.wait()
        self.halted = True
        self.stop.set()
        self.progress.set()

    def _train_version(self) -> int:
        """The version that will train what this step collects now (stream mode: it moves as batches are taken)."""
        return self.gate.train_version if self.gate is not None else self.version

    async def _take_ready(self) -> None:
        if self.ctx.buffer is None:
            return
        ready = await call_maybe_remote(self.ctx.buffer, "take_ready", self.target, timeout=self.rpc_timeout)
        for g in ready:
            gid = group_id(g)
            if self.cap.ready_is_stale(g, self._train_version()):
                self.rejected[gid] = "stale_ready"  # finished at an older policy than the cap allows
            else:
                self.accepted.append(g)
                self.bar.update(1)
        self.counts["ready_in"] = len(ready)

    # ---- group supply: parked first, then fresh -------------------------------------
    async def _next_groups(self, num: int) -> list[list[Sample]]:
        async with self.fetch_lock:
            out: list[list[Sample]] = []
            if self.ctx.buffer is not None and num > 0:
                parked = await call_maybe_remote(self.ctx.buffer, "take_parked", num, timeout=self.rpc_timeout)
                st = self.cap.at_resume(parked, self._train_version())
                self.counts.update({f"staleness_{k}": v for k, v in st.items()})
                out.extend(parked)
                self.resumed.extend(group_id(g) for g in parked)
            if len(out) < num and not self.exhausted:
                fresh = await call_maybe_remote(self.ctx.data_source, "get_groups", num - len(out), timeout=self.rpc_timeout)
                for g in fresh:
                    if len(g) != self.n:
                        raise RolloutError(f"data source returned group {group_id(g)} with {len(g)} samples; "
                                           f"--n-samples-per-prompt is {self.n}")
                if fresh and self.ctx.buffer is not None:
                    await call_maybe_remote(self.ctx.buffer, "issue", fresh, timeout=self.rpc_timeout)
                if len(fresh) < num - len(out):
                    self.exhausted = True
                out.extend(fresh)
            for g in out:
                gid = group_id(g)
                if gid in self.groups:
                    raise RolloutError(f"group {gid} was handed out twice in step {self.rollout_id}")
                self.groups[gid] = StepGroup(g, resumed=gid in self.resumed)
                self.submitted.append(gid)
            return out

    def _active_groups(self) -> int:
        return sum(1 for st in self.groups.values() if st.outcome is None)

    # ---- chunked mode ----------------------------------------------------------------
    async def _run_chunked(self, sem: asyncio.Semaphore, concurrency: int) -> None:
        while True:
            self.progress.clear()
            if self.errors or self.halted or self._filled():
                return
            while not self.exhausted and self._active_groups() + len(self.accepted) + len(self.failed) < self.target:
                groups = await self._next_groups(self.chunk)
                for g in groups:
                    self._start_group(g, sem)
            # APRIL keeps the engines full: as soon as fewer requests are in flight or queued than an
            # over-sampling chunk's worth (at most the concurrency), top up with parked, then fresh groups,
            # instead of letting the chunk drain. Not without --partial-rollout: what is unfinished at the
            # target would be thrown away.
            free = min(concurrency, self.chunk * self.n) - len(self.tasks)
            if self.partial and free > 0 and not self.exhausted and not self.stop.is_set():
                groups = await self._next_groups(-(-free // self.n))
                self.counts["refill_groups"] += len(groups)
                for g in groups:
                    self._start_group(g, sem)
            if self._active_groups() == 0:
                logger.warning("rollout step %d: data exhausted with %d/%d groups accepted",
                               self.rollout_id, len(self.accepted), self.target)
                return
            await self._wait_progress()

    async def _wait_progress(self) -> None:
        """Wait for a group to settle, checking each second that open groups still have work running."""
        while not self.progress.is_set():
            try:
                await asyncio.wait_for(self.progress.wait(), timeout=1.0)
            except TimeoutError:
                if self._active_groups() and not self.tasks and not self.reward_tasks:
                    open_ids = [gid for gid, st in self.groups.items() if st.outcome is None]
                    self._fail(f"groups {open_ids[:10]} are neither generating nor being rewarded (lost tasks)")

    def _begin_group(self, group: list[Sample]) -> list[tuple[StepGroup, Sample]]:
        """The group's unfinished members, to be generated; a group with none left is rewarded at once."""
        st = self.groups[group_id(group)]
        todo = [s for s in group if not s.status.is_finished]
        st.outstanding = len(todo)
        if not todo:  # everything finished already (e.g. a resumed group whose last member hit the budget)
            self._group_generated(st)
        return [(st, s) for s in todo]

    def _start_group(self, group: list[Sample], sem: asyncio.Semaphore | None) -> None:
        for st, s in self._begin_group(group):
            self._spawn(self._sample_task(st, s, sem), self.tasks)

    def _spawn(self, coro, bucket: set) -> None:
        task = asyncio.create_task(coro)
        bucket.add(task)
        task.add_done_callback(bucket.discard)

    async def _sample_task(self, st: StepGroup, sample: Sample, sem: asyncio.Semaphore | None) -> None:
        try:
            if sem is None:
                done = await self.requester.generate(sample, self.stop)
            else:
                async with sem:
                    done = await self.requester.generate(sample, self.stop)
        except Exception as e:
            if self.faults and (isinstance(e, EngineUnreachableError)
                                or (isinstance(e, EngineHTTPError) and e.status >= 500)):
                return  # on the failed engine: the sample keeps the tokens it last returned and is parked
            self._fail(f"group {st.samples[0].group_index} sample {sample.index}: {type(e).__name__}: {e}")
            return
        if done:
            st.outstanding -= 1
            if st.outstanding == 0:
                self._group_generated(st)
        self.progress.set()  # a request slot is free: chunked mode tops up

    def _fail(self, msg: str) -> None:
        if not self.errors:
            logger.error("rollout step %d: %s; stopping the step", self.rollout_id, msg)
        self.errors.append(msg)
        self.stop.set()
        self.progress.set()

    # ---- pool mode (CoPRIS): slime/rollout/pool_mode.py keeps the requests in flight ------------
    async def _run_pool(self, pool_size: int) -> None:
        async def fetch(num: int) -> list[tuple[StepGroup, Sample]]:
            return [item for g in await self._next_groups(num) for item in self._begin_group(g)]

        pool = SamplePool(pool_size, first_fetch=-(-pool_size // self.n), fetch=fetch,
                          run=lambda st, s: self._sample_task(st, s, None),
                          stop=self.stop, exhausted=lambda: self.exhausted, fail=self._fail)
        workers = pool.start()
        for w in workers:
            self.tasks.add(w)
            w.add_done_callback(self.tasks.discard)
        while True:
            self.progress.clear()
            if self.errors or self.halted or self._filled():
                return
            if all(w.done() for w in workers) and not self.reward_tasks:
                logger.warning("rollout step %d: data exhausted with %d/%d groups accepted",
                               self.rollout_id, len(self.accepted), self.target)
                return
            try:
                await asyncio.wait_for(self.progress.wait(), timeout=1.0)
            except TimeoutError:
                pass

    def _metrics(self, occ: dict[str, float], in_flight_cap: int) -> dict[str, float]:
        return step_metrics(self, occ, in_flight_cap)


__all__ = ["generate_rollout", "generate_rollout_async", "RolloutError", "RolloutEngineFaultError", "run_sync"]
