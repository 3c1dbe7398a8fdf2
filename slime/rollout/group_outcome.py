"""What a rollout step's finished group becomes (slime/rollout/sglang_rollout.py): rewarded in its own task
(a slow reward never blocks generation or the drain), then failed (no trainable sample: dropped with its
cause, counted toward the target), rejected by `--dynamic-sampling-filter-path` (dropped with the filter's
reason), accepted toward the target (the last one stops the step), or overflow (finished after the target:
kept ready for the next step).

`GroupOutcome` is a mixin of `_RolloutStep`: it reads the step's args, filter, clock and stop event and
writes the group's `outcome` and the step's accepted / overflow / rejected / failed lists.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from slime.rollout.rm_hub import reward_group
from slime.utils.ledger import group_failure_reason, group_id
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class StepGroup:
    """A group in play in this step."""

    samples: list[Sample]
    resumed: bool
    outstanding: int = 0  # members still being generated in this step
    outcome: str | None = None  # accepted | overflow | rejected | failed (no trainable sample)
    finished_t: float | None = None  # seconds into the step when its last member finished


class GroupOutcome:
    def _group_generated(self, st: StepGroup) -> None:
        self.counts["groups_finished"] += 1
        st.finished_t = self.clock.now()
        self._spawn(self._reward_task(st), self.reward_tasks)

    async def _reward_task(self, st: StepGroup) -> None:
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

    def _settle_group(self, st: StepGroup) -> None:
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

    def _place_group(self, st: StepGroup, reason: str | None) -> None:
        """A rewarded group with something to train: rejected (filter), accepted toward the target, or overflow
        (kept ready). Stream mode (slime/rollout/stream.py) places groups its own way."""
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
