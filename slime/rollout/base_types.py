"""Types shared by rollout functions and the rollout manager, in upstream slime's shape.

A rollout function (`--rollout-function-path`) is called as upstream slime calls it:

    generate_rollout(args, rollout_id, data_source, evaluation=False)

`data_source` is a `RolloutContext`: upstream's data-source interface (`get_samples(num)`: parked groups
first, then fresh ones; `add_samples(groups)`: groups handed back for a later step; `len()`), plus what the
built-in APRIL step uses (the buffer, the engines, the tokenizer, the policy version, the over-sampling
size). The function returns upstream's `RolloutFnTrainOutput` / `RolloutFnEvalOutput`, a plain list of
groups (upstream's legacy form), or our `RolloutOutput`; `to_rollout_output` reads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.rollout.buffer import RPC_TIMEOUT_S, call_sync, take_groups
from slime.rollout.staleness import StalenessCap
from slime.utils.ledger import DROPPED, FINISHED, group_id, is_group_finished
from slime.utils.misc import run_sync
from slime.utils.types import Sample, Status


@dataclass
class RolloutOutput:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    # groups dropped this step: group id -> reason ("reward_failed: ...", a filter's reason, ...); the driver
    # names the common cause when steps keep training nothing
    dropped: dict[int, str] = field(default_factory=dict)


@dataclass
class RolloutFnTrainOutput:
    """Upstream slime's training output of a rollout function: groups of samples and metrics."""

    samples: list[list[Sample]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    """Upstream slime's eval output: {set name: {"rewards": [...], "truncated": [...], "samples": [...]}}."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutContext:
    """What a rollout function gets as upstream's `data_source`; owned by the RolloutManager."""

    data_source: Any  # RolloutDataSource: fresh groups (`get_groups`)
    buffer: Any  # the partial-rollout buffer (Ray actor handle or PartialRolloutBuffer); None for evaluation
    engines: Any  # EngineGroup
    tokenizer: Any
    policy_version: int = 0  # the version the engines serve (and that trains this step's groups)
    # evaluation=True: the groups to generate (one eval set), instead of data_source/buffer
    eval_groups: list[list[Sample]] | None = None
    # --over-sampling-batch-size auto's planner (slime/rollout/simulator/planner.py), living across steps
    over_sampling: Any = None
    # pool mode's --admission (slime/rollout/admission.py), living across steps; None: fixed --rollout-pool-size
    admission: Any = None
    cap: StalenessCap | None = None  # --max-staleness's cap (the RolloutManager's): parked groups handed out again
    n_samples_per_prompt: int | None = None  # each group's size, checked as groups are handed out
    # --agent-env: the ToolAgent (slime/rollout/multi_turn/) the multi-turn generate runs with; it lives as long as
    # the manager, so a tool call left running at a park is picked up, never run twice, in a later step
    agent: Any = None
    # ids handed out by get_samples and not yet handed back or returned (the manager settles them)
    issued: set[int] = field(default_factory=set)

    # ---- upstream slime's data-source interface ----------------------------------------------
    def get_samples(self, num: int) -> list[list[Sample]]:
        """`num` groups: parked partial groups first (the staleness cap applied), then fresh ones (the step's own
        `take_groups`); each is `issued` in the ledger until it is returned for training or handed back with
        `add_samples`."""
        parked, fresh, _ = run_sync(take_groups(self.buffer, self.data_source, num, self.n_samples_per_prompt,
                                                self.cap, self.policy_version, RPC_TIMEOUT_S))
        self.issued.update(group_id(g) for g in parked + fresh)
        return parked + fresh

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Hand groups back for a later step: unfinished ones are parked (resumed first), finished ones held
        ready."""
        unfinished = [g for g in groups if not is_group_finished(g)]
        finished = [g for g in groups if is_group_finished(g)]
        if unfinished and self.buffer is not None:
            call_sync(self.buffer, "park", unfinished)
        if finished and self.buffer is not None:
            call_sync(self.buffer, "mark", [group_id(g) for g in finished], FINISHED)
            call_sync(self.buffer, "hold_ready", finished)
        self.issued.difference_update(group_id(g) for g in groups)

    def __len__(self) -> int:
        return len(self.data_source)

    def settle_issued(self, returned: list[list[Sample]]) -> dict[int, str]:
        """After a rollout function returned `returned`: those it got from `get_samples` are finished; any other
        group it got and neither returned nor handed back is dropped (it can never come back)."""
        if self.buffer is None:
            return {}
        ids = {group_id(g) for g in returned} & self.issued
        if ids:
            call_sync(self.buffer, "mark", sorted(ids), FINISHED)
        lost = sorted(self.issued - ids)
        if lost:
            call_sync(self.buffer, "mark", lost, DROPPED, "not_returned_by_rollout_function")
        self.issued.clear()
        return {gid: "not_returned_by_rollout_function" for gid in lost}


def to_rollout_output(result: Any, where: str, version: int) -> RolloutOutput:
    """A rollout function's training result as a `RolloutOutput`: ours, upstream's `RolloutFnTrainOutput`, or a
    plain list of groups. Samples a plugin filled in upstream's way (fields set directly) get what they left
    out (`Sample.complete_response`)."""
    if isinstance(result, RolloutOutput):
        return result
    if isinstance(result, RolloutFnTrainOutput):
        groups, metrics = result.samples, dict(result.metrics or {})
    elif isinstance(result, list):
        groups, metrics = result, {}
    else:
        raise TypeError(f"{where}: a training rollout returns RolloutFnTrainOutput, RolloutOutput or a list of "
                        f"groups, got {type(result).__name__}")
    # a group may hold a list in a sample's place (upstream's fan-out from a list-returning generate): flattened
    groups = [[s for x in g for s in (x if isinstance(x, list) else [x])] if isinstance(g, list) else [g]
              for g in groups]
    for g in groups:
        for s in g:
            if not isinstance(s, Sample):
                raise TypeError(f"{where}: groups must hold Samples, got {type(s).__name__}")
            s.complete_response(version, where)
    return RolloutOutput(groups=groups, metrics={k: float(v) for k, v in metrics.items()
                                                 if isinstance(v, (int, float)) and not isinstance(v, bool)})


def eval_output_metrics(result: Any, where: str, reward_key: str | None = None) -> dict[str, float]:
    """Metrics of an evaluation result: upstream's `RolloutFnEvalOutput` (or its dict) per set name."""
    data = result.data if isinstance(result, RolloutFnEvalOutput) else result
    if not isinstance(data, dict):
        raise TypeError(f"{where}: an evaluation returns RolloutFnEvalOutput or {{name: {{'rewards': [...]}}}}, "
                        f"got {type(result).__name__}")
    out: dict[str, float] = {}
    for name, d in data.items():
        rewards = [float(r[reward_key] if isinstance(r, dict) else r) for r in d.get("rewards", [])]
        if rewards:
            out[f"eval/{name}/mean"] = sum(rewards) / len(rewards)
            out[f"eval/{name}/accuracy"] = sum(1 for r in rewards if r > 0) / len(rewards)
        truncated = d.get("truncated") or []
        if truncated:
            out[f"eval/{name}/truncated_ratio"] = sum(bool(t) for t in truncated) / len(truncated)
        samples = d.get("samples") or []
        out[f"eval/{name}/failed_samples"] = float(sum(1 for s in samples if getattr(s, "status", None) is Status.FAILED))
    if isinstance(result, RolloutFnEvalOutput) and result.metrics:
        out.update({k: float(v) for k, v in result.metrics.items() if isinstance(v, (int, float))})
    return out
