"""One APRIL rollout step, top to bottom: `run_step`, the loop of upstream slime's `generate_rollout_async`.

    ready groups from the last step count first                          placement.take_ready
    while the target is not met (and nothing failed, no halt):
        add groups: parked first (the staleness cap applied), then fresh   supply.top_up    (step_supply.py)
        each group's task: generate every member -> reward -> judge         play             (group_outcome.py)
        wait for the first task to finish                                   asyncio.wait(FIRST_COMPLETED)
        place each judged group: accepted (toward the target)               place
    stop: abort every engine until idle, drain every request               stop_and_drain
    settle the groups still being rewarded: overflow, kept ready           place(stopped=True)
    commit: finished marked, rejected dropped, unfinished parked           commit

It returns its `StepRecord` and never raises for what goes wrong inside: `step_error(record)` names it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from slime.backends.sglang_utils.http_client import EngineHTTPError, EngineUnreachableError
from slime.rollout.buffer import call_maybe_remote
from slime.rollout.group_outcome import judge
from slime.rollout.step_record import RolloutError, StepConfig, StepGroup, StepRecord
from slime.utils.ledger import DROPPED, FINISHED, group_id

logger = logging.getLogger(__name__)

# with --reward-timeout <= 0 (no per-reward limit) the step still stops waiting for rewards after the drain
UNLIMITED_REWARD_SETTLE_S = 300.0
# after an engine failed and the live ones are idle, requests still pending are on the failed one
FAULT_DRAIN_GRACE_S = 2.0


@dataclass
class StepIO:
    """What a step talks to (inputs only)."""

    buffer: Any  # the partial-rollout buffer (a Ray actor handle or the object)
    data_source: Any  # fresh groups (`get_groups(num)`)
    engines: Any  # `abort_all_until_idle(timeout, session=, exclude=)`
    requester: Any  # its counters: new_tokens, requests, in_flight, peak_in_flight, timeline
    generate: Callable[[Any, asyncio.Event], Awaitable[bool]]  # (sample, stop) -> finished (else stopped)
    reward: Callable[[list], Awaitable[None]]
    filter: Callable[[list, Any], str | None] | None = None  # (a group, the StepRecord) -> why it is dropped, or None
    session: Any = None
    watchdog: Any = None  # the engines': faults, changed, check_once() (None: nothing watches them)
    progress: Callable[[], None] | None = None  # a group accepted (a progress bar)


async def run_step(io: StepIO, config: StepConfig, supply, placement, halt: asyncio.Event | None = None) -> StepRecord:
    rec = StepRecord(config, placement.target, supply.in_flight_cap, supply.chunk)
    stop = asyncio.Event()  # the requests' signal: set once the loop is left
    slots = asyncio.Semaphore(rec.in_flight_cap)
    requests: set[asyncio.Task] = set()  # one per member being generated (or waiting for a slot)
    playing: dict[asyncio.Task, StepGroup] = {}  # one per group in play, in the order they were submitted
    rewarding: dict[int, int] = {}  # group id -> rows, for groups generated whose reward (and judgement) still runs

    def going() -> bool:  # the stop rule
        return not (rec.filled() or rec.errors or rec.halted)

    async def generate(st: StepGroup, sample) -> bool:
        try:
            async with slots:
                return await io.generate(sample, stop)
        except Exception as e:
            if live_faults(io) and (isinstance(e, EngineUnreachableError)
                                    or (isinstance(e, EngineHTTPError) and e.status >= 500)):
                return False  # on the engine the watchdog found failed: the sample keeps its last tokens (parked)
            raise RolloutError(f"group {group_id(st.samples)} sample {sample.index}: {type(e).__name__}: {e}") from e
        finally:
            requests.discard(asyncio.current_task())
            if all(s.status.is_finished for s in st.samples):  # its group's last member: the reward is next,
                rewarding[group_id(st.samples)] = len(st.samples)  # counted before the supply looks again
            signals.slot_freed()  # the supply may top up

    async def play(st: StepGroup, members: list[asyncio.Task]) -> StepGroup | None:
        """Generate -> reward -> judge: the judged group, or None if a member was stopped unfinished."""
        try:
            if members:
                await asyncio.wait(members, return_when=asyncio.FIRST_EXCEPTION)
                for t in members:  # a failed request stops the step (its siblings are drained with the others)
                    if t.done() and not t.cancelled() and t.exception():
                        raise t.exception()
                if not all(not t.cancelled() and t.result() for t in members):
                    return None
            rec.finished_groups += 1
            st.finished_t = rec.clock.now()
            rewarding[group_id(st.samples)] = len(st.samples)
            await judge(io, rec, st)
            return st
        finally:
            rewarding.pop(group_id(st.samples), None)

    def submit(group: list) -> None:
        st = rec.groups[group_id(group)]
        members = [asyncio.ensure_future(generate(st, s)) for s in group if not s.status.is_finished]
        requests.update(members)
        playing[asyncio.ensure_future(play(st, members))] = st

    def place(task: asyncio.Task, stopped: bool) -> None:
        """A group's task ended: a failed group counts toward the target while it is not met; one that passed is
        accepted while the step goes on, else it is overflow (kept ready for the next step)."""
        playing.pop(task)
        try:
            st = task.result()
        except Exception as e:
            return rec.fail(str(e) if isinstance(e, RolloutError) else f"{type(e).__name__}: {e}")
        if st is None or st.outcome == "rejected" or (st.outcome == "failed" and rec.filled()):
            return
        if st.outcome == "failed":
            rec.failed.append(group_id(st.samples))
        elif stopped or not going():
            st.outcome = "overflow"
            rec.overflow.append(st.samples)
            return
        else:
            st.outcome = "accepted"
            placement.accept(rec, st.samples)
        if rec.filled():
            rec.clock.mark("target")

    signals = Signals(io, halt, supply)
    try:
        await placement.take_ready(rec, io)
        while going():
            for group in await supply.top_up(rec, io, len(playing), len(requests), sum(rewarding.values())):
                submit(group)
            if not playing and rec.exhausted:
                logger.warning("rollout step %d: data exhausted with %d/%s groups accepted", config.rollout_id,
                               len(rec.accepted), rec.target)
                break
            done, _ = await asyncio.wait({*playing, *signals.futures()}, return_when=asyncio.FIRST_COMPLETED)
            for task in [t for t in playing if t in done]:
                place(task, stopped=False)
            signals.read(rec)
    except Exception as e:  # stop cleanly: drain, keep finished groups, then raise RolloutError
        rec.fail(f"{type(e).__name__}: {e}")
    finally:
        signals.close()
        stop.set()
        await stop_and_drain(rec, io, requests)
    if playing:  # rewards still running after the drain (bounded); what finishes now is overflow
        done, pending = await asyncio.wait(set(playing), timeout=config.reward_settle_s)
        for task in [t for t in playing if t in done]:
            place(task, stopped=True)
        if pending:
            await cancel(pending)
            rec.fail(f"{len(pending)} reward tasks still running {config.reward_settle_s:.0f}s after the drain")
    rec.clock.mark("rewarded")
    await commit(rec, io.buffer)
    return rec


# ---- the end: abort until idle and drain, then commit ----------------------------------------------------
async def stop_and_drain(rec: StepRecord, io, requests: set) -> None:
    rec.clock.mark("stop")
    rec.abort_point = {"t": round(rec.clock.now(), 4), "accepted": len(rec.accepted),
                       "finished_groups": rec.finished_groups, "in_flight": io.requester.in_flight}
    timeout = rec.config.abort_timeout
    deadline = rec.clock.now() + timeout
    while True:
        try:  # (nothing of ours running, e.g. paused at a version gate while an eval uses the engines: no abort)
            if io.requester.in_flight:
                rec.abort_to_idle = rec.abort_to_idle or float(await abort_live_engines(rec, io) or 0.0)
        except Exception as e:
            if rec.errors:
                logger.warning("abort after failure also failed: %s", e)
            else:
                rec.fail(f"aborting the engines: {type(e).__name__}: {e}")
        if requests:  # requests that reached an engine after it reported idle are aborted in the next round
            await asyncio.wait(set(requests), timeout=FAULT_DRAIN_GRACE_S if live_faults(io) else 1.0)
        if not requests:
            break
        if live_faults(io):  # the live engines are idle: what is still pending waits on the failed engine
            logger.warning("rollout step %d: %d requests were on the failed engine; their samples resume from "
                           "the tokens it last returned", rec.config.rollout_id, len(requests))
        elif rec.clock.now() > deadline:
            rec.fail(f"{len(requests)} requests still pending {timeout}s after the abort")
        else:
            continue
        await cancel(requests)
        break
    rec.clock.mark("drained")
    if rec.errors and not live_faults(io) and io.watchdog is not None:
        await io.watchdog.check_once()  # did a request fail because an engine died?
    note_faults(rec, io)


async def cancel(tasks) -> None:
    for t in list(tasks):
        t.cancel()
    await asyncio.wait(set(tasks), timeout=10)


async def abort_live_engines(rec: StepRecord, io):
    """Abort-all on every engine not known to have failed, until idle; one found failed meanwhile is left at once."""
    while True:
        known = set(live_faults(io))
        call = io.engines.abort_all_until_idle(timeout=rec.config.abort_timeout, session=io.session, exclude=known)
        if io.watchdog is None:
            return await call
        abort = asyncio.ensure_future(call)
        while not abort.done() and not set(live_faults(io)) - known:
            io.watchdog.changed.clear()
            fault = asyncio.ensure_future(io.watchdog.changed.wait())
            await asyncio.wait({abort, fault}, return_when=asyncio.FIRST_COMPLETED)
            fault.cancel()
        if abort.done():
            return abort.result()
        abort.cancel()  # and again, without the engine that just failed
        await asyncio.wait({abort})
        logger.warning("rollout step %d: %s failed during the abort; aborting the other engines again",
                       rec.config.rollout_id, ", ".join(sorted(set(live_faults(io)) - known)))


async def commit(rec: StepRecord, buffer) -> None:
    """Ledger + buffer: finished marked, rejected dropped, unfinished parked, overflow held ready."""
    unfinished = []
    for g in [st.samples for st in rec.open_groups()]:  # finished ones: their reward never settled (timed out)
        if all(s.status.is_finished for s in g):
            rec.rejected[group_id(g)] = "reward_unsettled"
        else:
            unfinished.append(g)
    partial = rec.config.partial
    rec.parked, rec.discarded = (len(unfinished), 0) if partial else (0, len(unfinished))
    if buffer is None:
        return
    finished_ids = [group_id(g) for g in rec.accepted + rec.overflow if group_id(g) in rec.groups]
    by_reason: dict[str, list[int]] = {}
    for gid, reason in rec.rejected.items():
        by_reason.setdefault(reason, []).append(gid)
    calls = [("mark", finished_ids, FINISHED)] if finished_ids else []
    calls += [("mark", ids, DROPPED, reason) for reason, ids in by_reason.items()]
    if unfinished:
        calls.append(("park", unfinished) if partial else
                     ("mark", [group_id(g) for g in unfinished], DROPPED, "discarded_unfinished"))
    if rec.overflow:
        calls.append(("hold_ready", rec.overflow))
    if (rec.errors or rec.halted) and rec.accepted:  # the caller never sees them: keep them for the next step
        calls.append(("hold_ready", rec.accepted))
    for name, *a in calls:
        await call_maybe_remote(buffer, name, *a, timeout=rec.config.rpc_timeout)


# ---- plumbing: engine faults, and what else wakes the loop ----------------------------------------------
def live_faults(io) -> dict:  # url -> EngineFault: what the watchdog found failed so far
    return io.watchdog.faults if io.watchdog is not None else {}


def note_faults(rec: StepRecord, io) -> None:
    """Each engine the watchdog named since the last look stops the step (its samples keep their last tokens)."""
    for url, fault in list(live_faults(io).items()):
        if url not in rec.faults:
            rec.faults[url] = fault
            rec.fail(f"{fault.describe()} while generating rollout step {rec.config.rollout_id} "
                     f"({io.requester.in_flight} requests in flight, {len(rec.accepted)}/{rec.target} groups accepted)")


class Signals:
    """What else wakes the loop: a request that ended (a free slot: the supply may top up), the caller's halt,
    an engine the watchdog names, the supply's gate reopening (stream mode); `read` records them."""

    def __init__(self, io: StepIO, halt: asyncio.Event | None, supply):
        self.io, self.halt, self.supply = io, halt, supply
        self.slot = asyncio.get_running_loop().create_future()
        self.waiters: dict[Callable, asyncio.Future] = {}

    def slot_freed(self) -> None:
        if not self.slot.done():
            self.slot.set_result(None)

    def futures(self) -> set:
        for wait in (self.halt and self.halt.wait, self.io.watchdog and self.io.watchdog.changed.wait,
                     self.supply.gate_closed()):
            if wait and wait not in self.waiters:
                self.waiters[wait] = asyncio.ensure_future(wait())
        return {self.slot, *self.waiters.values()}

    def read(self, rec: StepRecord) -> None:
        self.waiters = {w: t for w, t in self.waiters.items() if not t.done()}
        self.slot = asyncio.get_running_loop().create_future() if self.slot.done() else self.slot
        if self.io.watchdog is not None:
            self.io.watchdog.changed.clear()  # (note_faults reads every fault reported so far)
        rec.halted = rec.halted or (self.halt is not None and self.halt.is_set())
        note_faults(rec, self.io)

    def close(self) -> None:
        for task in [self.slot, *self.waiters.values()]:
            task.cancel()


__all__ = ["StepIO", "run_step"]
