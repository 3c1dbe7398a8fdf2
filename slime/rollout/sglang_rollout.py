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
4. once `--rollout-batch-size` groups are accepted: abort every engine until
   idle, drain every request (each returns its partial tokens), then with
   `--partial-rollout` park every unfinished group in the buffer (finished
   members kept), without it drop them ("discarded_unfinished");
5. groups accepted after the target was met are kept `finished` in the buffer
   and returned first next step (nothing is thrown away).

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
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from slime.backends.sglang_utils.http_client import EngineHTTPError, EngineUnreachableError
from slime.backends.sglang_utils.watchdog import EngineFault, EngineFaultError, EngineWatchdog
from slime.rollout.base_types import RolloutContext, RolloutOutput
from slime.rollout.pool_mode import SamplePool
from slime.rollout.rm_hub import reward_group, reward_timeout
from slime.rollout.rollout_metrics import OccupancySampler, StepClock, step_metrics
from slime.rollout.sampling_request import SampleRequester, call_maybe_remote, sampling_params_from_args
from slime.rollout.staleness import apply_staleness_policy
from slime.utils.ledger import DROPPED, FINISHED, group_failure_reason, group_id
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

# with --reward-timeout <= 0 (no per-reward limit) the step still stops waiting for rewards after the drain
UNLIMITED_REWARD_SETTLE_S = 300.0
# after an engine failed and the live ones are idle, requests still pending are on the failed one
FAULT_DRAIN_GRACE_S = 2.0


class RolloutError(RuntimeError):
    """A rollout step could not complete; finished groups were kept in the buffer first."""


class RolloutEngineFaultError(RolloutError, EngineFaultError):
    """A rollout step stopped because engines died or froze (`.faults` names them); nothing was lost."""

    def __init__(self, message: str, faults: list[EngineFault]):
        EngineFaultError.__init__(self, message, faults)


@dataclass
class _Group:
    samples: list[Sample]
    resumed: bool
    outstanding: int = 0  # members still being generated in this step
    outcome: str | None = None  # accepted | overflow | rejected | failed (no trainable sample)
    finished_t: float | None = None  # seconds into the step when its last member finished


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


class _RolloutStep:
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
        self.max_staleness = args.max_staleness
        self.staleness_policy = args.staleness_policy
        fpath = args.dynamic_sampling_filter_path
        self.filter = load_function(fpath) if fpath else None
        self.rpc_timeout = args.rollout_rpc_timeout
        self.abort_timeout = args.rollout_abort_timeout
        self.groups: dict[int, _Group] = {}
        self.accepted: list[list[Sample]] = []
        self.overflow: list[list[Sample]] = []
        self.rejected: dict[int, str] = {}
        self.failed: list[int] = []  # groups with no trainable sample, counted toward the target
        self.faults: dict[str, EngineFault] = {}
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
                    await self._run_chunked(asyncio.Semaphore(concurrency))
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
            if self.max_staleness is not None and any(
                    v < self._train_version() - self.max_staleness for s in g for v in s.weight_versions):
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
                st = apply_staleness_policy(parked, self._train_version(), self.max_staleness, self.staleness_policy)
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
                self.groups[gid] = _Group(g, resumed=gid in self.resumed)
                self.submitted.append(gid)
            return out

    def _active_groups(self) -> int:
        return sum(1 for st in self.groups.values() if st.outcome is None)

    # ---- chunked mode ----------------------------------------------------------------
    async def _run_chunked(self, sem: asyncio.Semaphore) -> None:
        while True:
            self.progress.clear()
            if self.errors or self.halted or self._filled():
                return
            while not self.exhausted and self._active_groups() + len(self.accepted) + len(self.failed) < self.target:
                groups = await self._next_groups(self.chunk)
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

    def _begin_group(self, group: list[Sample]) -> list[tuple[_Group, Sample]]:
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

    async def _sample_task(self, st: _Group, sample: Sample, sem: asyncio.Semaphore | None) -> None:
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

    def _fail(self, msg: str) -> None:
        if not self.errors:
            logger.error("rollout step %d: %s; stopping the step", self.rollout_id, msg)
        self.errors.append(msg)
        self.stop.set()
        self.progress.set()

    # ---- pool mode (CoPRIS): slime/rollout/pool_mode.py keeps the requests in flight ------------
    async def _run_pool(self, pool_size: int) -> None:
        async def fetch(num: int) -> list[tuple[_Group, Sample]]:
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

    # ---- reward + filter, one task per finished group -----------------------------------
    def _group_generated(self, st: _Group) -> None:
        self.counts["groups_finished"] += 1
        st.finished_t = self.clock.now()
        self._spawn(self._reward_task(st), self.reward_tasks)

    async def _reward_task(self, st: _Group) -> None:
        try:
            await reward_group(self.args, st.samples)
        except asyncio.CancelledError:  # the step gave up waiting (_settle_rewards): the group stays unsettled
            self.progress.set()
            raise
        except Exception as e:  # reward_group promises not to raise; be safe anyway
            for s in st.samples:
                if s.reward is None:
                    s.status = Status.FAILED
                    s.metadata["failure"] = f"reward: {type(e).__name__}: {e}"
        try:
            self._settle_group(st)
        finally:
            self.progress.set()  # whatever happened, the loops waiting on this group move on

    def _settle_group(self, st: _Group) -> None:
        gid = group_id(st.samples)
        failure = group_failure_reason(st.samples)
        if failure is not None:  # nothing to train on: dropped with its cause, counted toward the target
            st.outcome = "failed"
            self.rejected[gid] = failure
            if not self._filled():
                self.failed.append(gid)
                if self._filled():
                    self.clock.mark("target")
                    self.stop.set()
            return
        reason = None
        if self.filter is not None:
            try:
                out = self.filter(self.args, st.samples)
                reason = None if out.keep else (out.reason or "filtered")
            except Exception as e:
                reason = f"filter_error: {type(e).__name__}"
                logger.warning("dynamic-sampling filter failed on group %s: %s", st.samples[0].group_index, e)
        self._place_group(st, reason)

    def _place_group(self, st: _Group, reason: str | None) -> None:
        """A rewarded group with something to train: rejected (filter), accepted toward the target, or overflow
        (kept ready)."""
        gid = group_id(st.samples)
        if reason is not None:
            st.outcome = "rejected"
            self.rejected[gid] = reason
        elif not self._filled() and not self.stop.is_set():
            st.outcome = "accepted"
            self.accepted.append(st.samples)
            self.bar.update(1)
            if self._filled():
                self.clock.mark("target")
                self.stop.set()
        else:
            st.outcome = "overflow"
            self.overflow.append(st.samples)

    # ---- stop: abort, drain, settle ------------------------------------------------------
    async def _stop_and_drain(self, session) -> None:
        self.stop.set()
        self.clock.mark("stop")
        self.abort_point = {"t": round(self.clock.now(), 4), "accepted": len(self.accepted),
                            "finished_groups": self.counts["groups_finished"], "in_flight": self.requester.in_flight}
        self.abort_to_idle = 0.0
        deadline = self.clock.now() + self.abort_timeout
        while True:
            try:
                # nothing of ours running (e.g. paused at a version gate while an eval uses the engines): no abort
                if self.requester.in_flight:
                    res = self.ctx.engines.abort_all_until_idle(timeout=self.abort_timeout, session=session,
                                                                exclude=set(self.faults))
                    res = await res if asyncio.iscoroutine(res) else res
                    self.abort_to_idle = self.abort_to_idle or float(res or 0.0)
            except Exception as e:
                if not self.errors:
                    self._fail(f"aborting the engines: {type(e).__name__}: {e}")
                else:
                    logger.warning("abort after failure also failed: %s", e)
            if not self.tasks:
                break
            # requests that reached an engine after it reported idle are aborted in the next round
            await asyncio.wait(set(self.tasks), timeout=FAULT_DRAIN_GRACE_S if self.faults else 1.0)
            if not self.tasks:
                break
            if self.faults:  # the live engines are idle: what is still pending waits on the failed engine
                logger.warning("rollout step %d: %d requests were on the failed engine; their samples resume from "
                               "the tokens it last returned", self.rollout_id, len(self.tasks))
                for t in list(self.tasks):
                    t.cancel()
                await asyncio.wait(set(self.tasks), timeout=10)
                break
            if self.clock.now() > deadline:
                self._fail(f"{len(self.tasks)} requests still pending {self.abort_timeout}s after the abort")
                for t in list(self.tasks):
                    t.cancel()
                await asyncio.wait(set(self.tasks), timeout=10)
                break
        self.clock.mark("drained")

    async def _settle_rewards(self) -> None:
        timeout = (reward_timeout(self.args) or UNLIMITED_REWARD_SETTLE_S) + 30.0
        if self.reward_tasks:
            done, pending = await asyncio.wait(set(self.reward_tasks), timeout=timeout)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=10)
                self._fail(f"{len(pending)} reward tasks still running {timeout:.0f}s after the drain")
        self.clock.mark("rewarded")

    async def _commit(self) -> None:
        """Ledger + buffer: finished groups, rejected, parked or discarded (one batch of buffer calls)."""
        open_groups = [st.samples for st in self.groups.values() if st.outcome is None]
        unfinished = [g for g in open_groups if not all(s.status.is_finished for s in g)]
        for g in open_groups:  # generated but its reward never settled (timed out / cancelled)
            if all(s.status.is_finished for s in g):
                self.rejected[group_id(g)] = "reward_unsettled"
        buf = self.ctx.buffer
        finished_ids = [group_id(g) for g in self.accepted + self.overflow if group_id(g) in self.groups]
        by_reason: dict[str, list[int]] = {}
        for gid, reason in self.rejected.items():
            by_reason.setdefault(reason, []).append(gid)
        self.counts["parked"] = len(unfinished) if self.partial else 0
        self.counts["discarded"] = 0 if self.partial else len(unfinished)
        if buf is None:
            return
        calls = [("mark", finished_ids, FINISHED)] if finished_ids else []
        calls += [("mark", ids, DROPPED, reason) for reason, ids in by_reason.items()]
        if unfinished and self.partial:
            calls.append(("park", unfinished))
        elif unfinished:
            calls.append(("mark", [group_id(g) for g in unfinished], DROPPED, "discarded_unfinished"))
        if self.overflow:
            calls.append(("hold_ready", self.overflow))
        if (self.errors or self.halted) and self.accepted:  # the caller never sees them: keep them for the next step
            calls.append(("hold_ready", self.accepted))
        for name, *a in calls:
            await call_maybe_remote(buf, name, *a, timeout=self.rpc_timeout)

    def _metrics(self, occ: dict[str, float], in_flight_cap: int) -> dict[str, float]:
        return step_metrics(self, occ, in_flight_cap)


__all__ = ["generate_rollout", "generate_rollout_async", "RolloutError", "RolloutEngineFaultError", "run_sync"]
