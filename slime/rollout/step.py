"""One APRIL rollout step, top to bottom (the shape of upstream slime's `generate_rollout_async`):

    ready groups from the last step count first                 placement.take_ready
    until the target is met:                                     supply.run
        supply: parked groups first (the staleness cap applied once), then fresh ones      (step_supply.py)
        submit every unfinished sample, wait for them                                        submit_group
        each finished group: rewarded, then failed / rejected / accepted / overflow         (group_outcome.py)
    abort until idle, drain every request                        stop_and_drain     (step_end.py)
    settle the rewards still running                             settle_rewards
    commit to the buffer: finished marked, rejected dropped, unfinished parked, overflow ready    commit

`run_step(state, io, supply, placement)` runs it on a `StepState` (slime/rollout/step_state.py). How groups
are fed (chunked over-sampling with top-ups, or a pool of requests always in flight) is the `supply`, where
accepted groups go (toward a target, or straight to stream mode's queue) is the `placement`, and what the
step talks to is the `StepIO`: the real engines behind the router (slime/rollout/sglang_rollout.py) or the
simulator's engines on a simulated clock (slime/rollout/simulator/drive.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from slime.backends.sglang_utils.http_client import EngineHTTPError, EngineUnreachableError
from slime.backends.sglang_utils.watchdog import EngineFault, EngineFaultError
from slime.rollout.group_outcome import group_generated
from slime.rollout.step_end import commit, fail, settle_rewards, stop_and_drain
from slime.rollout.step_state import StepGroup, StepState

logger = logging.getLogger(__name__)


class RolloutError(RuntimeError):
    """A rollout step could not complete; finished groups were kept in the buffer first."""


class RolloutEngineFaultError(RolloutError, EngineFaultError):
    """A rollout step stopped because engines died or froze (`.faults` names them); nothing was lost."""

    def __init__(self, message: str, faults: list[EngineFault]):
        EngineFaultError.__init__(self, message, faults)


@dataclass
class StepIO:
    """What a step talks to.

    `buffer` / `data_source`: the partial-rollout buffer and the fresh-group source (Ray handles or plain
    objects); `engines`: `abort_all_until_idle(timeout, session=, exclude=)`; `requester`: its counters
    (`new_tokens`, `requests`, `in_flight`, `peak_in_flight`, `timeline`); `generate(sample, stop) -> bool`
    (finished, or stopped and aborted); `reward(samples)`; `filter(samples) -> reason | None`; `monitors`:
    started with the step and stopped after its drain (`stop()` returns metrics)."""

    buffer: Any
    data_source: Any
    engines: Any
    requester: Any
    generate: Callable[[Any, asyncio.Event], Awaitable[bool]]
    reward: Callable[[list], Awaitable[None]]
    filter: Callable[[list], str | None] | None = None
    session: Any = None
    monitors: Any = None
    monitor_metrics: dict | None = None


async def run_step(state: StepState, io: StepIO, supply, placement, halt: asyncio.Event | None = None) -> None:
    """Run one step on `state` (see the module docstring); never raises for what goes wrong inside the step:
    the error is in `state.errors` and `step_error(state)` names it."""
    watchers = [asyncio.ensure_future(_guard_lost_work(state))]
    if halt is not None:
        watchers.append(asyncio.ensure_future(_watch_halt(state, halt)))
    try:
        await placement.take_ready(state, io)
        if not state.filled():
            await supply.run(state, io, placement)
    except Exception as e:  # stop cleanly: drain, keep finished groups, then raise RolloutError
        fail(state, f"{type(e).__name__}: {e}")
    finally:
        for w in watchers:
            w.cancel()
        await stop_and_drain(state, io)
        if io.monitors is not None:
            io.monitor_metrics = await io.monitors.stop(state)
    await settle_rewards(state)
    await commit(state, io.buffer)


async def _guard_lost_work(state: StepState) -> None:
    """Each second: groups still open with nothing generating or rewarding them would never settle."""
    while not state.stop.is_set():
        await asyncio.sleep(1.0)
        if state.open_groups() and not state.tasks and not state.reward_tasks:
            open_ids = [gid for gid, st in state.groups.items() if st.outcome is None]
            fail(state, f"groups {open_ids[:10]} are neither generating nor being rewarded (lost tasks)")


async def _watch_halt(state: StepState, halt: asyncio.Event) -> None:
    await halt.wait()
    state.halted = True
    state.stop.set()
    state.progress.set()


def engine_fault(state: StepState, fault: EngineFault, in_flight: int) -> None:
    """The watchdog named a failed engine: the step stops (its samples there keep their last tokens)."""
    state.faults[fault.url] = fault
    state.fault_seen.set()
    fail(state, f"{fault.describe()} while generating rollout step {state.rollout_id} ({in_flight} "
                f"requests in flight, {len(state.accepted)}/{state.target} groups accepted)")


def step_error(state: StepState) -> RolloutError | None:
    """The error a failed step raises (after its commit), naming the failed engines first."""
    if not state.errors:
        return None
    cause = state.errors[0] + (f" (+{len(state.errors) - 1} more)" if len(state.errors) > 1 else "")
    if state.faults:  # name the engine first: the requests' own errors (a 503 from the router) say less
        cause = "; ".join(f.describe() for f in state.faults.values()) + f" (the step saw: {cause})"
    msg = (f"rollout step {state.rollout_id} failed: {cause}; kept {len(state.accepted) + len(state.overflow)} "
           f"finished groups in the buffer, {state.counts['parked']} parked, {state.counts['discarded']} dropped")
    if state.faults:
        return RolloutEngineFaultError(msg, list(state.faults.values()))
    return RolloutError(msg)


# ---- submit / wait -------------------------------------------------------------------------------------
def begin_group(state: StepState, io: StepIO, group: list, placement) -> list[tuple[StepGroup, Any]]:
    """The group's unfinished members, to be generated; a group with none left is judged at once."""
    st = state.groups[group[0].group_index]
    todo = [s for s in group if not s.status.is_finished]
    st.outstanding = len(todo)
    if not todo:  # everything finished already (e.g. a resumed group whose last member hit the budget)
        group_generated(state, io, st, placement)
    return [(st, s) for s in todo]


def submit_group(state: StepState, io: StepIO, group: list, placement, sem: asyncio.Semaphore | None) -> None:
    """One request task per unfinished member (at most `sem`'s worth in flight)."""
    for st, s in begin_group(state, io, group, placement):
        state.spawn(sample_task(state, io, st, s, placement, sem), state.tasks)


async def sample_task(state: StepState, io: StepIO, st: StepGroup, sample, placement,
                      sem: asyncio.Semaphore | None = None) -> None:
    """Generate `sample` until it finishes or the step stops; the group's last finisher sends it to judgement."""
    try:
        if sem is None:
            done = await io.generate(sample, state.stop)
        else:
            async with sem:
                done = await io.generate(sample, state.stop)
    except Exception as e:
        if state.faults and (isinstance(e, EngineUnreachableError)
                             or (isinstance(e, EngineHTTPError) and e.status >= 500)):
            return  # on the failed engine: the sample keeps the tokens it last returned and is parked
        fail(state, f"group {st.samples[0].group_index} sample {sample.index}: {type(e).__name__}: {e}")
        return
    if done:
        st.outstanding -= 1
        if st.outstanding == 0:
            group_generated(state, io, st, placement)
    state.progress.set()  # a request slot is free: the supply tops up


async def wait_progress(state: StepState) -> None:
    """Wait for a request or a group to settle, a failure or a halt (`_guard_lost_work` fails the step if open
    groups lose their work)."""
    await state.progress.wait()


__all__ = ["RolloutError", "RolloutEngineFaultError", "StepIO", "begin_group", "engine_fault", "run_step",
           "sample_task", "step_error", "submit_group", "wait_progress"]
