"""Types shared by rollout functions and the rollout manager."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample


@dataclass
class RolloutContext:
    """What a rollout function may use; owned by the RolloutManager."""

    data_source: Any  # RolloutDataSource
    buffer: Any  # Buffer actor handle (None for evaluation)
    engines: Any  # EngineGroup
    tokenizer: Any
    policy_version: int = 0
    # evaluation=True: the groups to generate (one eval set), instead of data_source/buffer
    eval_groups: list[list[Sample]] | None = None
    # an aiohttp.ClientSession on the caller's running event loop, reused across steps so connections
    # stay open (its connector must allow the in-flight cap); None: the step opens and closes its own
    http_session: Any = None
    # train_async.py: a VersionGate (slime/rollout/version_gate.py) that every request passes, so the
    # caller can pause the step for an in-flight weight update; the step's staleness cap and version
    # metrics use gate.train_version (the version that will train this batch) instead of policy_version
    gate: Any = None
    # train_async.py: an asyncio.Event on the step's loop; once set, the step stops as at its target,
    # parks its unfinished groups and keeps its accepted ones in the buffer (ready), returning no groups
    halt: Any = None
    # --over-sampling-batch-size auto: the OverSamplingPlanner (slime/rollout/over_sampling.py) that lives across
    # steps (the RolloutManager owns it); it sizes each step and learns from it
    over_sampling_planner: Any = None


@dataclass
class RolloutOutput:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    # groups dropped this step: group id -> reason ("reward_failed: ...", a filter's reason, ...); the driver
    # names the common cause when steps keep training nothing
    dropped: dict[int, str] = field(default_factory=dict)
