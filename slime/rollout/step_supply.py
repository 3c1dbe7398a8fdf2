"""How a step feeds the engines: parked groups first, then fresh ones, as chunks or as a pool.

`next_groups(state, io, num)` is the supply itself: up to `num` groups, the buffer's parked groups first
(FIFO or `--buffer-filter-path`; the staleness cap applied to them once, here), then fresh groups from the
data source (recorded `issued` in the ledger). Two strategies call it:

- `ChunkedSupply` (`--rollout-mode chunked`, APRIL): submit `--over-sampling-batch-size` groups at a time
  while (groups in play + accepted) < target, with at most `--sglang-server-concurrency` x engines requests
  in flight; with `--partial-rollout`, top up as soon as fewer requests are in flight than a chunk's worth,
  so the engines stay full instead of draining a chunk.
- `PoolSupply` (`--rollout-mode pool`, CoPRIS; and stream mode's segments): exactly `pool_size` requests in
  flight for the whole step; a worker that finishes takes the next unfinished sample, refilling from the
  supply one group at a time (the first fetch fills the whole pool in one buffer round trip). `gate`
  (stream mode) holds new groups back while paused (backpressure, an update, an eval).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from slime.rollout.sampling_request import call_maybe_remote
from slime.rollout.step import RolloutError, begin_group, sample_task, submit_group, wait_progress
from slime.rollout.step_end import fail
from slime.rollout.step_state import StepGroup, StepState
from slime.utils.ledger import group_id

logger = logging.getLogger(__name__)


async def next_groups(state: StepState, io, num: int) -> list[list]:
    """Up to `num` groups: parked first (staleness cap applied), then fresh; registered in `state.groups`."""
    async with state.fetch_lock:
        out: list[list] = []
        if io.buffer is not None and num > 0:
            parked = await call_maybe_remote(io.buffer, "take_parked", num, timeout=state.rpc_timeout)
            counts = state.cap.at_resume(parked, state.train_version())
            state.counts.update({f"staleness_{k}": v for k, v in counts.items()})
            out.extend(parked)
            state.resumed.extend(group_id(g) for g in parked)
        if len(out) < num and not state.exhausted:
            fresh = await call_maybe_remote(io.data_source, "get_groups", num - len(out), timeout=state.rpc_timeout)
            for g in fresh:
                if len(g) != state.n:
                    raise RolloutError(f"data source returned group {group_id(g)} with {len(g)} samples; "
                                       f"--n-samples-per-prompt is {state.n}")
            if fresh and io.buffer is not None:
                await call_maybe_remote(io.buffer, "issue", fresh, timeout=state.rpc_timeout)
            if len(fresh) < num - len(out):
                state.exhausted = True
            out.extend(fresh)
        resumed = set(state.resumed)
        for g in out:
            gid = group_id(g)
            if gid in state.groups:
                raise RolloutError(f"group {gid} was handed out twice in step {state.rollout_id}")
            state.groups[gid] = StepGroup(g, resumed=gid in resumed)
            state.submitted.append(gid)
        return out


def _data_exhausted(state: StepState) -> None:
    logger.warning("rollout step %d: data exhausted with %d/%s groups accepted", state.rollout_id,
                   len(state.accepted), state.target)


class FixedOverSampling:
    """A fixed `--over-sampling-batch-size` (slime/rollout/over_sampling.py resolves the flag; `auto` is a planner
    with the same three methods)."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"--over-sampling-batch-size must be >= 1, got {size}")
        self.choice = int(size)

    def size(self) -> int:
        return self.choice

    def metrics(self) -> dict[str, float]:
        return {}

    async def after_step(self, state: StepState, engines) -> None:
        return None


class ChunkedSupply:
    """Over-sampled chunks with top-ups (APRIL). `over_sampling` sizes each step's chunk (a fixed size or
    `--over-sampling-batch-size auto`'s planner); `concurrency_per_engine` caps the requests in flight."""

    def __init__(self, over_sampling, concurrency_per_engine: int, top_ups: bool):
        self.over_sampling = over_sampling
        self.concurrency_per_engine = concurrency_per_engine
        self.top_ups = top_ups  # --partial-rollout: what is unfinished at the target is parked, not thrown away

    def prepare(self, state: StepState) -> None:
        state.chunk = self.over_sampling.size()
        state.in_flight_cap = self.concurrency_per_engine * state.num_engines

    def metrics(self) -> dict[str, float]:
        return self.over_sampling.metrics()

    async def after_step(self, state: StepState, engines) -> None:
        await self.over_sampling.after_step(state, engines)

    async def run(self, state: StepState, io, placement) -> None:
        concurrency = state.in_flight_cap
        sem = asyncio.Semaphore(concurrency)
        while True:
            state.progress.clear()
            if state.errors or state.halted or state.filled():
                return
            while not state.exhausted and len(state.open_groups()) + len(state.accepted) + len(state.failed) < state.target:
                for g in await next_groups(state, io, state.chunk):
                    submit_group(state, io, g, placement, sem)
            # APRIL keeps the engines full: as soon as fewer requests are in flight or queued than an
            # over-sampling chunk's worth (at most the concurrency), top up with parked, then fresh groups,
            # instead of letting the chunk drain.
            free = min(concurrency, state.chunk * state.n) - len(state.tasks)
            if self.top_ups and free > 0 and not state.exhausted and not state.stop.is_set():
                groups = await next_groups(state, io, -(-free // state.n))
                state.counts["refill_groups"] += len(groups)
                for g in groups:
                    submit_group(state, io, g, placement, sem)
            if not state.open_groups():
                _data_exhausted(state)
                return
            await wait_progress(state)


class PoolSupply:
    """`pool_size` requests always in flight (CoPRIS); `gate`: new groups wait while it is held (stream mode)."""

    def __init__(self, pool_size: int, gate=None):
        self.pool_size = pool_size
        self.gate = gate

    def prepare(self, state: StepState) -> None:
        state.in_flight_cap = self.pool_size

    def metrics(self) -> dict[str, float]:
        return {}

    async def after_step(self, state: StepState, engines) -> None:
        return None

    async def run(self, state: StepState, io, placement) -> None:
        queue: deque[tuple[StepGroup, object]] = deque()
        refill = asyncio.Lock()
        first = [max(1, -(-self.pool_size // state.n))]  # the first fetch fills the pool; later ones, one group

        async def next_item():
            while not queue:
                if state.stop.is_set() or state.exhausted:
                    return None
                async with refill:  # one worker refills; the others then find the queue full
                    if queue:
                        break
                    if self.gate is not None and not await self.gate.wait_open(state.stop):
                        return None  # issue nothing while paused (lag, update, eval)
                    num, first[0] = first[0], 1
                    for g in await next_groups(state, io, num):
                        queue.extend(begin_group(state, io, g, placement))
            return queue.popleft()

        async def worker():
            while not state.stop.is_set():
                try:
                    item = await next_item()
                except Exception as e:
                    fail(state, f"fetching groups: {type(e).__name__}: {e}")
                    return
                if item is None or state.stop.is_set():
                    return
                await sample_task(state, io, *item, placement)

        workers = [state.spawn(worker(), state.tasks) for _ in range(self.pool_size)]
        for w in workers:
            w.add_done_callback(lambda _: state.progress.set())
        while True:
            state.progress.clear()
            if state.errors or state.halted or state.filled():
                return
            if all(w.done() for w in workers) and not state.reward_tasks:
                _data_exhausted(state)
                return
            await wait_progress(state)
