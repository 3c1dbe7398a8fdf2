"""Stream mode (`train_async.py --rollout-mode stream`): a pool of requests in flight across training steps, each
accepted group queued at once, `take` handing out batches; beyond `--max-async-lag` the gate is held. It runs in
segments (`rollout.step` with a gated pool); `quiesce()` parks everything in the buffer for a checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import Callable

from slime.rollout.base_types import RolloutOutput
from slime.rollout.buffer import call_maybe_remote
from slime.rollout.length_bias import length_bias_metrics
from slime.rollout.rollout_metrics import sample_metrics, staleness_metrics, token_version_metrics
from slime.rollout.staleness import IN_FLIGHT_COUNTS
from slime.rollout.step_record import RolloutEngineFaultError, RolloutError, StepRecord
from slime.rollout.version_gate import VersionGate
from slime.utils.ledger import DROPPED, FINISHED, group_id
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

TAKE_POLL_S = 5.0


class StreamPlacement:
    """Stream mode's segments: no target; each accepted group goes to the stream's queue (`accept(group)`)."""

    target = None

    def __init__(self, accept: Callable[[list], None]):
        self._accept = accept

    async def take_ready(self, rec: StepRecord, io) -> None:
        return  # the stream hands ready groups out itself

    def accept(self, rec: StepRecord, group: list) -> None:
        self._accept(group)


class StreamRollout:
    """The stream's state on the rollout's event loop, driving the run's `rollout` ahead of the trainer."""

    def __init__(self, rollout, first_rollout_id: int, num_rollout: int, version_offset: int, max_lag: int):
        self.rollout = rollout
        self.gate: VersionGate = rollout.run_ahead(self)
        self.buffer, self.rpc_timeout = rollout.buffer, rollout.config.rpc_timeout
        self.batch_size = rollout.config.batch_size
        self.max_lag = int(max_lag)  # --max-async-lag
        self.offset = int(version_offset)
        self.next_batch = int(first_rollout_id)  # the next batch take() hands out
        self.num_rollout = int(num_rollout)  # no batch beyond the last one is collected
        self.queue: deque[tuple[list[Sample], int]] = deque()  # (group, engine version when it joined a batch)
        self.waiting: list[list[Sample]] = []  # finished, accepted, not yet within the lag of a batch
        self.finished_in_ledger: set[int] = set()  # ids already `finished` (came back from the ready list)
        self.changed = asyncio.Event()
        self.exhausted = False
        self.error: str | None = None
        self.engine_fault: RolloutEngineFaultError | None = None  # a segment that lost an engine (it names it)
        self._segment_task: asyncio.Task | None = None
        self._halt: asyncio.Event | None = None
        self._balance_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._tokens_at_take = 0
        self._time_at_take = time.monotonic()
        self._staleness_at_take: Counter = Counter()
        self.max_queue = 0

    # ---- versions and room --------------------------------------------------------------
    def train_version(self, batch: int) -> int:
        return batch + self.offset

    def _fill_batch(self) -> int:
        return self.next_batch + len(self.queue) // self.batch_size

    def _room(self) -> bool:
        fill = self._fill_batch()
        return fill < self.num_rollout and self.train_version(fill) - self.gate.version <= self.max_lag

    def _admit_waiting(self) -> None:
        while self.waiting and self._room():
            self.queue.append((self.waiting.pop(0), self.gate.version))
        self.max_queue = max(self.max_queue, len(self.queue))
        self.gate.set_train_version(self.train_version(self._fill_batch()))

    def accept(self, group: list[Sample]) -> None:
        """An accepted group (called by the segment): queue it within the lag, or wait for room."""
        self.waiting.append(group)
        self._admit_waiting()
        self.changed.set()
        if not self._room():
            self._spawn(self.rebalance())

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._task_done)

    def _task_done(self, t: asyncio.Task) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None and self.error is None:  # e.g. the engines never drained
            self.error = f"backpressure: {type(t.exception()).__name__}: {t.exception()}"
            self.changed.set()

    async def rebalance(self) -> None:
        """Backpressure: hold the gate for "lag" while the batch being filled is beyond the lag, else release it."""
        async with self._balance_lock:
            self._admit_waiting()
            if self._room():
                self.gate.release("lag")
            elif "lag" not in self.gate.holds:
                logger.debug("stream: batch %d is %d versions ahead of the engines (v%d); pausing", self._fill_batch(),
                             self.train_version(self._fill_batch()) - self.gate.version, self.gate.version)
                await self.gate.hold("lag", self.rollout.engines, drain=False)
            self.changed.set()

    # ---- segments ----------------------------------------------------------------------
    async def resume(self) -> None:
        """Take the ready groups back (they come first) and start a segment."""
        n = await call_maybe_remote(self.buffer, "num_ready", timeout=self.rpc_timeout)
        ready = await call_maybe_remote(self.buffer, "take_ready", n, timeout=self.rpc_timeout) if n else []
        self.finished_in_ledger.update(group_id(g) for g in ready)
        self.waiting = ready + self.waiting
        self._admit_waiting()
        await self.rebalance()
        if not self.exhausted and self.error is None:
            self._halt = asyncio.Event()
            self._segment_task = asyncio.ensure_future(self._run_segment(self._halt))

    async def _run_segment(self, halt: asyncio.Event) -> None:
        try:  # the rollout's pool, gated: nothing new while paused (lag, update, eval)
            out = await self.rollout.step(self.next_batch, StreamPlacement(self.accept), halt)
            if not out.metrics.get("rollout/halted"):
                logger.warning("stream: the prompt data is exhausted; %d groups queued", len(self.queue))
                self.exhausted = True
        except Exception as e:  # noqa: BLE001 - handed to the trainer's take()
            self.error = f"{type(e).__name__}: {e}"
            self.engine_fault = e if isinstance(e, RolloutEngineFaultError) else None
            logger.error("stream segment failed: %s", self.error)
        finally:
            self.changed.set()

    async def quiesce(self) -> None:
        """End the segment (in flight -> parked, late finishers -> ready) and move queued groups to the buffer's ready list."""
        if self._segment_task is not None:
            self._halt.set()
            await self._segment_task
            self._segment_task = None
        groups = [g for g, _ in self.queue] + self.waiting
        self.queue.clear()
        self.waiting = []
        if groups:
            await self._mark_finished(groups)
            await call_maybe_remote(self.buffer, "hold_ready", groups, timeout=self.rpc_timeout)
        self.finished_in_ledger.clear()
        self.changed.set()

    async def _mark_finished(self, groups: list[list[Sample]]) -> None:
        ids = [group_id(g) for g in groups if group_id(g) not in self.finished_in_ledger]
        if ids:
            await call_maybe_remote(self.buffer, "mark", sorted(ids), FINISHED, timeout=self.rpc_timeout)
            self.finished_in_ledger.update(ids)

    # ---- the trainer's side -----------------------------------------------------------------
    async def take(self, rollout_id: int, timeout: float) -> RolloutOutput:
        """The next batch: `--rollout-batch-size` accepted groups, checked against `--max-staleness` at the
        version that trains them (stale ones dropped under `restart` and replaced by the next in line)."""
        if rollout_id != self.next_batch:
            raise ValueError(f"stream: asked for batch {rollout_id}, the next one is {self.next_batch}")
        version = self.train_version(rollout_id)
        t0 = time.monotonic()
        kept: list[tuple[list[Sample], int]] = []
        counts: Counter = Counter()
        dropped: list[int] = []
        stale_groups: list[list[Sample]] = []
        part: list[tuple[list[Sample], int]] = []
        try:
            while len(kept) < self.batch_size:
                await self._wait_for_groups(t0, timeout)
                if not self.queue:
                    break  # data exhausted
                part = [self.queue.popleft() for _ in range(min(self.batch_size - len(kept), len(self.queue)))]
                await self._mark_finished([g for g, _ in part])
                ok, stale, c = self.rollout.cap.before_training([g for g, _ in part], version)
                counts.update(c)
                ok_ids = {id(g) for g in ok}
                kept += [(g, a) for g, a in part if id(g) in ok_ids]
                part = []
                if stale:
                    stale_groups += stale
                    ids = sorted(group_id(g) for g in stale)
                    await call_maybe_remote(self.buffer, "mark", ids, DROPPED, "stale_at_train", timeout=self.rpc_timeout)
                    dropped += ids
        except asyncio.CancelledError:  # the run stops (AsyncRollout): what this take holds goes back to the queue
            self.queue.extendleft(reversed(kept + part))
            raise
        self.next_batch += 1
        waited = time.monotonic() - t0
        await self.rebalance()  # a batch left the queue: room for the next one
        groups = [g for g, _ in kept]
        metrics = self._metrics(kept, version, waited, counts, dropped)
        metrics.update(length_bias_metrics([s for g in groups for s in g], dropped=[s for g in stale_groups for s in g]))
        return RolloutOutput(groups=groups, metrics=metrics)

    async def _wait_for_groups(self, t0: float, timeout: float) -> None:
        while not self.queue:
            if self.engine_fault is not None:
                raise self.engine_fault
            if self.error is not None:
                raise RolloutError(f"stream rollout failed: {self.error}")
            if self.exhausted and not self.waiting:
                return
            if self.waiting and "lag" in self.gate.holds:
                await self.rebalance()
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), TAKE_POLL_S)
            except TimeoutError:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"stream: no accepted group for {timeout:.0f}s "
                                       f"(in flight {self.gate.in_flight}, gate holds {sorted(self.gate.holds)})")

    def _metrics(self, kept, version: int, waited: float, counts: Counter, dropped: list[int]) -> dict[str, float]:
        groups = [g for g, _ in kept]
        now = time.monotonic()
        tokens = self.rollout.new_tokens()
        new_tokens, elapsed = tokens - self._tokens_at_take, now - self._time_at_take
        self._tokens_at_take, self._time_at_take = tokens, now
        st = self.gate.staleness - self._staleness_at_take
        self._staleness_at_take = Counter(self.gate.staleness)
        newest = [max((v for s in g if (v := s.newest_version()) is not None), default=version) for g in groups]
        out: dict[str, float] = {
            "rollout/new_tokens": float(new_tokens),
            "rollout/tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
            "rollout/step_time_s": elapsed,
            "rollout/wait_s": waited,
            "rollout/policy_version": float(version),
            "rollout/groups_accepted": float(len(groups)),
            "rollout/groups_dropped": float(len(dropped)),
            "async/queue_groups": float(len(self.queue)),
            "async/queue_groups_max": float(self.max_queue),
            "async/waiting_groups": float(len(self.waiting)),
            "async/in_flight": float(self.gate.in_flight),
            "async/accept_lag_max": float(max((version - a for _, a in kept), default=0)),
            "async/group_lag_max": float(max((version - v for v in newest), default=0)),
        }
        if dropped:
            out["rollout/groups_dropped/stale_at_train"] = float(len(dropped))
        out.update(staleness_metrics(counts, ("stale_groups_at_train", "masked_tokens_at_train",
                                              "guard_masked_groups_at_train")))
        out.update(staleness_metrics(st, IN_FLIGHT_COUNTS, "rollout/staleness_in_flight_"))
        out.update(token_version_metrics(groups, version))
        out.update(sample_metrics(groups))
        if self.rollout.admission is not None:
            out.update(self.rollout.admission.metrics())
        self.max_queue = len(self.queue)
        return out


__all__ = ["StreamRollout"]
