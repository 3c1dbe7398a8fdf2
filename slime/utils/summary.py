"""The short end-of-run summary: what improved, how fast, and where things are."""

from __future__ import annotations

import json
import logging
import os

from slime.utils.metrics import read_metrics

logger = logging.getLogger(__name__)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r["step"] >= 0]
    rewards = [r.get("reward/mean") for r in steps]
    rewards = [r for r in rewards if r is not None]
    k = max(1, len(rewards) // 4)
    return {
        "steps": len(steps),
        "eval_accuracy_first": evals[0][1] if evals else None,
        "eval_accuracy_last": evals[-1][1] if evals else None,
        "reward_first_quarter": _mean(rewards[:k]),
        "reward_last_quarter": _mean(rewards[-k:]),
        "rollout_tokens_per_s": _mean([r.get("rollout/tokens_per_s") for r in steps]),
        "off_policy_token_ratio": _mean([r.get("rollout/off_policy_token_ratio") for r in steps]),
    }


def log_run_summary(run_dir: str, metrics_path: str, args) -> dict:
    summary = summarize(read_metrics(metrics_path)) if os.path.isfile(metrics_path) else {}
    summary["metrics"] = metrics_path
    summary["checkpoint"] = os.path.abspath(args.save) if args.save else None
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    def fmt(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "==== run summary ====",
        f"steps: {summary.get('steps', 0)}",
        f"eval accuracy: {fmt(summary.get('eval_accuracy_first'))} -> {fmt(summary.get('eval_accuracy_last'))}",
        f"reward (first -> last quarter of steps): {fmt(summary.get('reward_first_quarter'))} -> {fmt(summary.get('reward_last_quarter'))}",
        f"rollout tokens/s: {fmt(summary.get('rollout_tokens_per_s'), '.1f')}",
        f"off-policy token ratio: {fmt(summary.get('off_policy_token_ratio'))}",
        f"metrics: {metrics_path}",
        f"checkpoint: {summary['checkpoint'] or 'none (--save not set)'}",
    ]
    for line in lines:
        logger.info(line)
    return summary
