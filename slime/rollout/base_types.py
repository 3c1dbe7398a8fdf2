"""What a rollout function returns, in upstream slime's shape: upstream's outputs, a plain list of groups, or our
`RolloutOutput`, all read by `to_rollout_output`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime.utils.types import Sample, Status


@dataclass
class RolloutOutput:
    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)
    # groups dropped this step: group id -> reason (the driver names the common cause of empty steps)
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


def to_rollout_output(result: Any, where: str, version: int) -> RolloutOutput:
    """A rollout function's training result (ours, upstream's, or a list of groups) as a `RolloutOutput`."""
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
