"""The state of one APRIL rollout step: what the step's functions (slime/rollout/step.py and the modules it
names) read and write, and what the metrics, the trace, the over-sampling planner and the simulator read
afterwards. Nothing else holds step state: every field is public and documented here.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from slime.rollout.staleness import StalenessCap


@dataclass
class StepGroup:
    """A group in play in this step."""

    samples: list
    resumed: bool  # handed out again from the buffer's parked groups
    outstanding: int = 0  # members still being generated in this step
    outcome: str | None = None  # accepted | overflow | rejected | failed (no trainable sample); None: unfinished
    finished_t: float | None = None  # seconds into the step when its last member finished


class StepClock:
    """Marks of one step, in seconds since its start, on the running event loop's clock (the simulator's
    loop runs a simulated clock)."""

    def __init__(self) -> None:
        self._time = asyncio.get_running_loop().time
        self.t0 = self._time()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> float:
        self.marks[name] = self._time() - self.t0
        return self.marks[name]

    def now(self) -> float:
        return self._time() - self.t0

    def at(self, t: float) -> float:
        """A time on the loop's clock (e.g. the requester's timeline) as seconds into the step."""
        return t - self.t0


@dataclass
class StepState:
    rollout_id: int
    target: int | None  # groups to accept (None: no target, stream mode's segments)
    n: int  # samples per group
    partial: bool  # --partial-rollout: unfinished groups are parked (else dropped)
    cap: StalenessCap
    policy_version: int  # the version that trains this step's groups, as it stood at the start
    train_version: Callable[[], int]  # the same, now (stream mode: it moves as batches are taken)
    rpc_timeout: float  # buffer / data-source calls
    abort_timeout: float
    reward_settle_s: float  # how long the end waits for rewards still running after the drain
    clock: StepClock = field(default_factory=StepClock)
    num_engines: int = 1
    in_flight_cap: int = 0  # requests the supply keeps in flight at most
    chunk: int | None = None  # chunked supply: this step's over-sampling size
    # groups and their outcomes
    groups: dict[int, StepGroup] = field(default_factory=dict)  # every group handed out this step, by id
    accepted: list[list] = field(default_factory=list)  # toward the target (returned)
    overflow: list[list] = field(default_factory=list)  # finished after the target: kept ready for the next step
    rejected: dict[int, str] = field(default_factory=dict)  # dropped this step: group id -> reason
    failed: list[int] = field(default_factory=list)  # no trainable sample: dropped, counted toward the target
    ready_in: list[list] = field(default_factory=list)  # ready groups taken from the buffer at the start
    submitted: list[int] = field(default_factory=list)  # ids handed out, in order (parked ones first)
    resumed: list[int] = field(default_factory=list)  # the parked ones among them
    exhausted: bool = False  # the data source had no more fresh groups
    counts: Counter = field(default_factory=Counter)  # ready_in, refill_groups, groups_finished, staleness_*, ...
    # how the step is going
    errors: list[str] = field(default_factory=list)  # the first one stops the step
    faults: dict = field(default_factory=dict)  # engine url -> EngineFault (the watchdog's)
    halted: bool = False  # stopped by the caller (a checkpoint), not by its target
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set at the target, a failure or a halt
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set whenever a request or a group settles
    fault_seen: asyncio.Event = field(default_factory=asyncio.Event)  # set at each new engine fault
    fetch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one supply call at a time
    tasks: set = field(default_factory=set)  # sample requests (and pool workers) running
    reward_tasks: set = field(default_factory=set)
    # the end
    abort_point: dict = field(default_factory=dict)  # {t, accepted, finished_groups, in_flight} when it stopped
    abort_to_idle: float = 0.0  # seconds the first abort-all took to leave the engines idle

    def filled(self) -> bool:
        """The target is met: accepted groups plus groups that failed outright (nothing to train)."""
        return self.target is not None and len(self.accepted) + len(self.failed) >= self.target

    def open_groups(self) -> list[StepGroup]:
        """Groups with no outcome yet (generating, being rewarded, or unfinished)."""
        return [st for st in self.groups.values() if st.outcome is None]

    def spawn(self, coro, bucket: set) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        bucket.add(task)
        task.add_done_callback(bucket.discard)
        return task
