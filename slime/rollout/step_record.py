"""What one APRIL rollout step is asked (`StepConfig`), what it did (`StepRecord`, which run_step writes and the
metrics, the trace, the planner and the simulator read) and what a failed one raises (`step_error`)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from slime.backends.sglang_utils.watchdog import EngineFault, EngineFaultError
from slime.rollout.staleness import StalenessCap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepConfig:
    rollout_id: int
    n: int  # samples per group
    partial: bool  # --partial-rollout: unfinished groups are parked (else dropped)
    cap: StalenessCap
    policy_version: int  # the version that trains this step's groups, as it stood at the start
    train_version: Callable[[], int]  # the same, now (stream mode: it moves as batches are taken)
    rpc_timeout: float  # buffer / data-source calls
    abort_timeout: float
    reward_settle_s: float  # how long the end waits for rewards still running after the drain
    num_engines: int = 1


@dataclass
class StepGroup:
    """A group in play in this step."""

    samples: list
    outcome: str | None = None  # accepted | overflow | rejected | failed (no trainable sample); None: unfinished
    finished_t: float | None = None  # seconds into the step when its last member finished


class StepClock:
    """Marks of one step, in seconds since its start, on the running event loop's (maybe simulated) clock."""

    def __init__(self) -> None:
        self._time = asyncio.get_running_loop().time
        self.t0 = self._time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    def now(self) -> float:
        return self._time() - self.t0

    def at(self, t: float) -> float:  # a time on the loop's clock (the requester's timeline) into the step
        return t - self.t0


@dataclass
class StepRecord:
    config: StepConfig
    target: int | None  # groups to accept (None: no target, stream mode's segments)
    in_flight_cap: int  # requests in flight at most
    chunk: int | None  # chunked supply: this step's over-sampling size
    clock: StepClock = field(default_factory=StepClock)
    groups: dict[int, StepGroup] = field(default_factory=dict)  # every group handed out, by id, in order
    accepted: list[list] = field(default_factory=list)  # toward the target (returned)
    overflow: list[list] = field(default_factory=list)  # finished after the target: kept ready for the next step
    rejected: dict[int, str] = field(default_factory=dict)  # dropped this step: group id -> reason
    failed: list[int] = field(default_factory=list)  # no trainable sample: dropped, counted toward the target
    ready_in: list[list] = field(default_factory=list)  # ready groups taken from the buffer at the start
    resumed: list[int] = field(default_factory=list)  # the parked ones among them
    exhausted: bool = False  # the data source had no more fresh groups
    finished_groups: int = 0  # groups whose members all finished (before their reward)
    refilled_groups: int = 0  # chunked top-ups: groups added as requests finished, between chunks
    parked: int = 0  # unfinished groups parked at the commit (--partial-rollout)...
    discarded: int = 0  # ... or dropped
    staleness: Counter = field(default_factory=Counter)  # what the staleness cap did (staleness.STEP_COUNTS)
    errors: list[str] = field(default_factory=list)  # the first one stopped the step
    faults: dict = field(default_factory=dict)  # engine url -> EngineFault (the watchdog's)
    halted: bool = False  # stopped by the caller (a checkpoint), not by its target
    abort_point: dict = field(default_factory=dict)  # {t, accepted, finished_groups, in_flight} when it stopped
    abort_to_idle: float = 0.0  # seconds the first abort-all took to leave the engines idle

    def filled(self) -> bool:
        """The target is met: accepted groups plus groups that failed outright (nothing to train)."""
        return self.target is not None and len(self.accepted) + len(self.failed) >= self.target

    def fail(self, msg: str) -> None:
        """The step cannot go on: it stops (it still drains and keeps what finished, then raises)."""
        if not self.errors:
            logger.error("rollout step %d: %s; stopping the step", self.config.rollout_id, msg)
        self.errors.append(msg)

    def open_groups(self) -> list[StepGroup]:  # no outcome: unfinished, or its reward never settled
        return [st for st in self.groups.values() if st.outcome is None]


class RolloutError(RuntimeError):
    """A rollout step could not complete; finished groups were kept in the buffer first."""


class RolloutEngineFaultError(RolloutError, EngineFaultError):
    """A rollout step stopped because engines died or froze (`.faults` names them); nothing was lost."""

    def __init__(self, message: str, faults: list[EngineFault]):
        EngineFaultError.__init__(self, message, faults)


def step_error(rec: StepRecord) -> RolloutError | None:
    """The error a failed step raises (after its commit), naming the failed engines first."""
    if not rec.errors:
        return None
    cause = rec.errors[0] + (f" (+{len(rec.errors) - 1} more)" if len(rec.errors) > 1 else "")
    if rec.faults:  # name the engine first: the requests' own errors (a 503 from the router) say less
        cause = "; ".join(f.describe() for f in rec.faults.values()) + f" (the step saw: {cause})"
    msg = (f"rollout step {rec.config.rollout_id} failed: {cause}; kept {len(rec.accepted) + len(rec.overflow)} "
           f"finished groups in the buffer, {rec.parked} parked, {rec.discarded} dropped")
    if rec.faults:
        return RolloutEngineFaultError(msg, list(rec.faults.values()))
    return RolloutError(msg)
