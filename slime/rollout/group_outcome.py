"""What a finished group becomes: `judge` rewards it and says failed (no trainable sample), rejected (the
dynamic filter said no) or passed; the step (slime/rollout/step.py) accepts a passed group while it runs, to
its placement: `TargetPlacement` (train.py's step: toward a target) or `StreamPlacement` (stream mode's queue,
slime/rollout/stream.py).
"""

from __future__ import annotations

import logging
from typing import Callable

from slime.rollout.buffer import call_maybe_remote
from slime.rollout.step_record import StepGroup, StepRecord
from slime.utils.ledger import group_failure_reason, group_id
from slime.utils.types import Status

logger = logging.getLogger(__name__)


async def judge(io, rec: StepRecord, st: StepGroup) -> None:
    """Reward `st` (in the group's own task: a slow reward never blocks generation or the drain), then mark it
    failed (every member FAILED: dropped with its cause, counted toward the target, so a broken reward cannot
    make a step draw the whole dataset) or rejected, the reason in `rec.rejected`; a group that passed keeps
    `outcome` None for the step to place."""
    try:
        await io.reward(st.samples)
    except Exception as e:  # the reward promises not to raise; be safe anyway
        for s in st.samples:
            if s.reward is None:
                s.status = Status.FAILED
                s.metadata["failure"] = f"reward: {type(e).__name__}: {e}"
    gid = group_id(st.samples)
    reason = group_failure_reason(st.samples)
    if reason is not None:  # nothing to train on
        st.outcome = "failed"
    elif io.filter is not None:
        try:
            reason = io.filter(st.samples, rec)
        except Exception as e:
            reason = f"filter_error: {type(e).__name__}"
            logger.warning("dynamic-sampling filter failed on group %s: %s", gid, e)
        st.outcome = None if reason is None else "rejected"
    if reason is not None:
        rec.rejected[gid] = reason


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
