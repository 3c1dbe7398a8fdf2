"""What a finished group becomes, and where it goes (the step's outcome per group).

A group whose members all finished is rewarded in its own task (a slow reward never blocks generation or
the drain), then it is
- failed: no trainable sample (every member FAILED: its reward raised, the engine refused its prompt);
  dropped with its cause and counted toward the target, so a broken reward cannot make a step draw the
  whole dataset;
- rejected: `--dynamic-sampling-filter-path` said no; dropped with the filter's reason;
- accepted / overflow: placed by the step's placement. `TargetPlacement` (train.py's step): accepted
  toward the target, the last one stops the step; after that, overflow, kept ready for the next step.
  `StreamPlacement` (stream mode's segments, no target): accepted groups go to the stream's queue at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from slime.rollout.sampling_request import call_maybe_remote
from slime.rollout.step_state import StepGroup, StepState
from slime.utils.ledger import group_failure_reason, group_id
from slime.utils.types import Status

logger = logging.getLogger(__name__)


def group_generated(state: StepState, io, st: StepGroup, placement) -> None:
    """Every member of `st` finished generating: reward it in its own task, then judge it."""
    state.counts["groups_finished"] += 1
    st.finished_t = state.clock.now()
    state.spawn(reward_task(state, io, st, placement), state.reward_tasks)


async def reward_task(state: StepState, io, st: StepGroup, placement) -> None:
    try:
        await io.reward(st.samples)
    except asyncio.CancelledError:  # the step gave up waiting (settle_rewards): the group stays unsettled
        state.progress.set()
        raise
    except Exception as e:  # the reward promises not to raise; be safe anyway
        for s in st.samples:
            if s.reward is None:
                s.status = Status.FAILED
                s.metadata["failure"] = f"reward: {type(e).__name__}: {e}"
    try:
        settle_group(state, io, st, placement)
    finally:
        state.progress.set()  # whatever happened, the loops waiting on this group move on


def settle_group(state: StepState, io, st: StepGroup, placement) -> None:
    """A rewarded group's outcome: failed, rejected, or placed (accepted / overflow)."""
    gid = group_id(st.samples)
    failure = group_failure_reason(st.samples)
    if failure is not None:  # nothing to train on: dropped with its cause, counted toward the target
        st.outcome = "failed"
        state.rejected[gid] = failure
        placement.count_failed(state, gid)
        return
    reason = None
    if io.filter is not None:
        try:
            reason = io.filter(st.samples)
        except Exception as e:
            reason = f"filter_error: {type(e).__name__}"
            logger.warning("dynamic-sampling filter failed on group %s: %s", gid, e)
    if reason is not None:
        st.outcome = "rejected"
        state.rejected[gid] = reason
        return
    placement.place(state, st)


def target_met(state: StepState) -> None:
    state.clock.mark("target")
    state.stop.set()


class TargetPlacement:
    """train.py's step: ready groups from the last step count first; accepted groups count toward the target
    until it is met (the last one stops the step); groups finishing after that are overflow (kept ready)."""

    def __init__(self, target: int, on_accept: Callable[[], None] | None = None):
        self.target = target
        self.on_accept = on_accept  # e.g. a progress bar's update

    async def take_ready(self, state: StepState, io) -> None:
        if io.buffer is None or state.target is None:
            return
        ready = await call_maybe_remote(io.buffer, "take_ready", state.target, timeout=state.rpc_timeout)
        state.ready_in = list(ready)
        # finished at an older policy: the cap as before training (restart drops the group, mask masks, keep keeps)
        kept, stale, counts = state.cap.before_training(ready, state.train_version())
        state.counts.update({f"staleness_{k}": v for k, v in counts.items()})
        for g in stale:
            state.rejected[group_id(g)] = "stale_ready"
        for g in kept:
            self._accept(state, g)
        state.counts["ready_in"] = len(ready)

    def _accept(self, state: StepState, group: list) -> None:
        state.accepted.append(group)
        if self.on_accept is not None:
            self.on_accept()

    def count_failed(self, state: StepState, gid: int) -> None:
        if not state.filled():
            state.failed.append(gid)
            if state.filled():
                target_met(state)

    def place(self, state: StepState, st: StepGroup) -> None:
        if not state.filled() and not state.stop.is_set():
            st.outcome = "accepted"
            self._accept(state, st.samples)
            if state.filled():
                target_met(state)
        else:
            st.outcome = "overflow"
            state.overflow.append(st.samples)


class StreamPlacement:
    """Stream mode's segments (no target): an accepted group goes to the stream's queue at once
    (`accept(group)`); one finishing while the segment stops is overflow (the commit keeps it ready)."""

    target = None

    def __init__(self, accept: Callable[[list], None]):
        self.accept = accept

    async def take_ready(self, state: StepState, io) -> None:
        return  # the stream hands ready groups out itself

    def count_failed(self, state: StepState, gid: int) -> None:
        state.failed.append(gid)

    def place(self, state: StepState, st: StepGroup) -> None:
        if state.stop.is_set():
            st.outcome = "overflow"
            state.overflow.append(st.samples)
        else:
            st.outcome = "accepted"
            self.accept(st.samples)
