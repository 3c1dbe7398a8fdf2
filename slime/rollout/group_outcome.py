"""What a finished group becomes: `judge` rewards it and says failed (no trainable sample), rejected (the dynamic
filter said no) or passed; the step (step.py) hands a passed group to its placement (`TargetPlacement`,
`StreamPlacement`)."""

from __future__ import annotations

import logging

from slime.rollout.step_record import StepGroup, StepRecord
from slime.utils.ledger import group_failure_reason, group_id
from slime.utils.types import Status

logger = logging.getLogger(__name__)


async def judge(io, rec: StepRecord, st: StepGroup) -> None:
    """Reward the group in its own task, then mark it failed (counted toward the target, so a broken reward cannot
    drain the dataset) or rejected; a group that passed keeps `outcome` None."""
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


__all__ = ["judge"]
