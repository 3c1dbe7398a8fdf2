"""The end of a rollout step: abort until idle, drain, settle, commit.

Once the target is met (or the step fails, or is halted): abort every engine until idle and drain every
request (each returns its partial tokens; requests that reached an engine after it reported idle are
aborted in the next round; those on a failed engine are cancelled, their samples kept at the tokens it
last returned); then wait for the reward tasks still running (bounded: `--reward-timeout` + 30 s), and
hand the buffer the step's outcome in one batch of calls: finished groups marked, rejected ones dropped
with their reason, unfinished ones parked (`--partial-rollout`) or dropped, groups finished after the
target kept ready for the next step.
"""

from __future__ import annotations

import asyncio
import logging

from slime.rollout.sampling_request import call_maybe_remote
from slime.rollout.step_state import StepState
from slime.utils.ledger import DROPPED, FINISHED, group_id

logger = logging.getLogger(__name__)

# with --reward-timeout <= 0 (no per-reward limit) the step still stops waiting for rewards after the drain
UNLIMITED_REWARD_SETTLE_S = 300.0
# after an engine failed and the live ones are idle, requests still pending are on the failed one
FAULT_DRAIN_GRACE_S = 2.0


def fail(state: StepState, msg: str) -> None:
    """The step cannot go on: stop it (it still drains, keeps what finished, then raises)."""
    if not state.errors:
        logger.error("rollout step %d: %s; stopping the step", state.rollout_id, msg)
    state.errors.append(msg)
    state.stop.set()
    state.progress.set()


async def stop_and_drain(state: StepState, io) -> None:
    state.stop.set()
    state.clock.mark("stop")
    in_flight = io.requester.in_flight
    state.abort_point = {"t": round(state.clock.now(), 4), "accepted": len(state.accepted),
                         "finished_groups": state.counts["groups_finished"], "in_flight": in_flight}
    state.abort_to_idle = 0.0
    deadline = state.clock.now() + state.abort_timeout
    while True:
        try:
            # nothing of ours running (e.g. paused at a version gate while an eval uses the engines): no abort
            if io.requester.in_flight:
                res = await abort_live_engines(state, io)
                state.abort_to_idle = state.abort_to_idle or float(res or 0.0)
        except Exception as e:
            if not state.errors:
                fail(state, f"aborting the engines: {type(e).__name__}: {e}")
            else:
                logger.warning("abort after failure also failed: %s", e)
        if not state.tasks:
            break
        # requests that reached an engine after it reported idle are aborted in the next round
        await asyncio.wait(set(state.tasks), timeout=FAULT_DRAIN_GRACE_S if state.faults else 1.0)
        if not state.tasks:
            break
        if state.faults:  # the live engines are idle: what is still pending waits on the failed engine
            logger.warning("rollout step %d: %d requests were on the failed engine; their samples resume from "
                           "the tokens it last returned", state.rollout_id, len(state.tasks))
            await _cancel(state.tasks)
            break
        if state.clock.now() > deadline:
            fail(state, f"{len(state.tasks)} requests still pending {state.abort_timeout}s after the abort")
            await _cancel(state.tasks)
            break
    state.clock.mark("drained")


async def _cancel(tasks: set) -> None:
    for t in list(tasks):
        t.cancel()
    await asyncio.wait(set(tasks), timeout=10)


async def abort_live_engines(state: StepState, io):
    """Abort-all on every engine not known to have failed, until they are idle. An engine the watchdog finds
    failed while the abort waits on it (it stopped just before the step ended) leaves the abort at once: a
    stopped engine never answers, and the abort would otherwise wait out --rollout-abort-timeout."""
    while True:
        state.fault_seen.clear()
        known = set(state.faults)
        call = io.engines.abort_all_until_idle(timeout=state.abort_timeout, session=io.session, exclude=known)
        if not asyncio.iscoroutine(call):  # an engine group answering synchronously
            return call
        abort = asyncio.ensure_future(call)
        while not abort.done():
            fault = asyncio.ensure_future(state.fault_seen.wait())
            await asyncio.wait({abort, fault}, return_when=asyncio.FIRST_COMPLETED)
            fault.cancel()
            state.fault_seen.clear()
            if not abort.done() and set(state.faults) - known:
                abort.cancel()  # and again, without the engine that just failed
                await asyncio.wait({abort})
                logger.warning("rollout step %d: %s failed during the abort; aborting the other engines again",
                               state.rollout_id, ", ".join(sorted(set(state.faults) - known)))
                break
        else:
            return abort.result()


async def settle_rewards(state: StepState) -> None:
    """Wait (bounded) for the reward tasks still running after the drain."""
    if state.reward_tasks:
        timeout = state.reward_settle_s
        done, pending = await asyncio.wait(set(state.reward_tasks), timeout=timeout)
        if pending:
            await _cancel(pending)
            fail(state, f"{len(pending)} reward tasks still running {timeout:.0f}s after the drain")
    state.clock.mark("rewarded")


async def commit(state: StepState, buffer) -> None:
    """Ledger + buffer: finished groups marked, rejected dropped, unfinished parked or dropped, overflow held
    ready (one batch of buffer calls)."""
    open_groups = [st.samples for st in state.open_groups()]
    unfinished = [g for g in open_groups if not all(s.status.is_finished for s in g)]
    for g in open_groups:  # generated but its reward never settled (timed out / cancelled)
        if all(s.status.is_finished for s in g):
            state.rejected[group_id(g)] = "reward_unsettled"
    state.counts["parked"] = len(unfinished) if state.partial else 0
    state.counts["discarded"] = 0 if state.partial else len(unfinished)
    if buffer is None:
        return
    finished_ids = [group_id(g) for g in state.accepted + state.overflow if group_id(g) in state.groups]
    by_reason: dict[str, list[int]] = {}
    for gid, reason in state.rejected.items():
        by_reason.setdefault(reason, []).append(gid)
    calls = [("mark", finished_ids, FINISHED)] if finished_ids else []
    calls += [("mark", ids, DROPPED, reason) for reason, ids in by_reason.items()]
    if unfinished and state.partial:
        calls.append(("park", unfinished))
    elif unfinished:
        calls.append(("mark", [group_id(g) for g in unfinished], DROPPED, "discarded_unfinished"))
    if state.overflow:
        calls.append(("hold_ready", state.overflow))
    if (state.errors or state.halted) and state.accepted:  # the caller never sees them: keep them for the next step
        calls.append(("hold_ready", state.accepted))
    for name, *a in calls:
        await call_maybe_remote(buffer, name, *a, timeout=state.rpc_timeout)
