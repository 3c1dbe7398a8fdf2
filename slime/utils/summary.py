"""The short end-of-run summary: what improved, how fast, and where things are."""

from __future__ import annotations

import json
import logging
import os

from slime.utils.eval_scores import accuracy_line, first_to_last, gain_line
from slime.utils.metrics import read_metrics

logger = logging.getLogger(__name__)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _eval_tool_series(rows: list[dict], name: str) -> list[float]:
    """Per eval, the mean over eval sets of `eval/<set>/tool/<name>` (multi-turn runs)."""
    out = []
    for r in rows:
        vals = [v for k, v in r.items() if k.startswith("eval/") and k.endswith(f"/tool/{name}")]
        if vals:
            out.append(sum(vals) / len(vals))
    return out


LAG_PREFIX = "rollout/staleness_hist/lag_"


def max_lag(rows: list[dict]) -> int | None:
    """The largest lag (policy versions between a trained token's and the step's) of any trained token."""
    lags = [int(k[len(LAG_PREFIX):]) for r in rows for k, v in r.items() if k.startswith(LAG_PREFIX) and v]
    return max(lags, default=None)


def staleness_line(summary: dict, args) -> str:
    """One line: what the off-policy token ratio and the staleness cap mean for this run."""
    ratio, lag = summary.get("off_policy_token_ratio"), summary.get("max_lag")
    if ratio is None:
        return "off-policy token ratio: n/a"
    if not lag:
        return f"off-policy token ratio: {ratio:.3f} (every trained token was sampled by the policy it trained)"
    line = (f"off-policy token ratio: {ratio:.3f} = the share of trained tokens sampled by an older policy (resumed "
            f"partial rollouts; {'corrected by TIS' if args.use_tis else 'uncorrected: no --use-tis'}); largest lag {lag} "
            f"versions")
    if args.max_staleness is None:
        return line + " (no --max-staleness: uncapped)"
    if lag > args.max_staleness:  # said as it is: a token older than the cap reached the trainer
        return line + f", OVER --max-staleness {args.max_staleness}"
    fate = {"restart": "regenerated" if args.disable_length_guard else "kept as context, out of the loss (the length guard)",
            "mask": "kept as context, out of the loss", "keep": "trained, TIS-weighted"}
    return line + (f" <= --max-staleness {args.max_staleness} (older tokens are {fate[args.staleness_policy]}: "
                   f"--staleness-policy {args.staleness_policy})")


def summarize(rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    steps = [r for r in rows if r["step"] >= 0]
    rewards = [r.get("reward/mean") for r in steps]
    rewards = [r for r in rewards if r is not None]
    k = max(1, len(rewards) // 4)
    tools = {}
    rates = [r["rollout/tool/call_rate"] for r in steps if r.get("rollout/tool/call_rate") is not None]
    if rates:  # a multi-turn run (--agent-env): how tool use moved
        q = max(1, len(rates) // 4)
        eval_rates, eval_calls = _eval_tool_series(rows, "call_rate"), _eval_tool_series(rows, "calls_per_sample_mean")
        tools = {
            "tool_call_rate_first_quarter": _mean(rates[:q]),
            "tool_call_rate_last_quarter": _mean(rates[-q:]),
            "eval_tool_call_rate_first": eval_rates[0] if eval_rates else None,
            "eval_tool_call_rate_last": eval_rates[-1] if eval_rates else None,
            "eval_tool_calls_per_sample_first": eval_calls[0] if eval_calls else None,
            "eval_tool_calls_per_sample_last": eval_calls[-1] if eval_calls else None,
            "tool_failures": sum(r.get("rollout/tool/failures", 0.0) for r in steps),
        }
    return {**tools,
        "steps": len(steps),
        "eval_accuracy_first": evals[0][1] if evals else None,
        "eval_accuracy_last": evals[-1][1] if evals else None,
        "reward_first_quarter": _mean(rewards[:k]),
        "reward_last_quarter": _mean(rewards[-k:]),
        "rollout_tokens_per_s": _mean([r.get("rollout/tokens_per_s") for r in steps]),
        "off_policy_token_ratio": _mean([r.get("rollout/off_policy_token_ratio") for r in steps]),
        "max_lag": max_lag(steps),
        **length_bias_summary(steps), **guard_summary(steps),
    }


LENGTH_KEYS = ("trained_mean", "sync_mean", "trained_p90", "sync_p90", "longest_decile_share")


def length_bias_summary(steps: list[dict]) -> dict:
    """The run's length bias: each `length/` metric's mean over the steps that have it (slime/rollout/length_bias.py)."""
    return {f"length_{k}": _mean([r.get(f"length/{k}") for r in steps]) for k in LENGTH_KEYS}


# the length guard's counts: samples masked instead of restarted, groups masked instead of dropped
GUARD_SAMPLE_KEYS = ("rollout/staleness_guard_masked", "rollout/staleness_in_flight_guard_masked")
GUARD_GROUP_KEY = "rollout/staleness_guard_masked_groups_at_train"


def guard_summary(steps: list[dict]) -> dict:
    """How often the length guard acted: samples it masked, groups it kept, steps in which it did either."""
    acted = [sum(r.get(k, 0.0) for k in (*GUARD_SAMPLE_KEYS, GUARD_GROUP_KEY)) for r in steps]
    return {"guard_masked_samples": sum(r.get(k, 0.0) for r in steps for k in GUARD_SAMPLE_KEYS),
            "guard_masked_groups": sum(r.get(GUARD_GROUP_KEY, 0.0) for r in steps),
            "guard_steps": sum(1 for a in acted if a)}


def guard_line(summary: dict, args) -> str:
    """One line: was the length guard on, and did it act?"""
    if args.max_staleness is None or args.staleness_policy != "restart":
        return "length guard: not needed (it bounds --staleness-policy restart under --max-staleness)"
    if args.disable_length_guard:
        return "length guard: off (--disable-length-guard): every sample over the cap was regenerated"
    return (f"length guard: on, acted in {summary.get('guard_steps', 0)} of {summary.get('steps', 0)} steps: "
            f"{summary.get('guard_masked_samples', 0):.0f} samples over the cap kept with their stale tokens masked "
            f"instead of regenerated, {summary.get('guard_masked_groups', 0):.0f} finished groups masked instead of "
            f"dropped")


def length_line(summary: dict) -> str:
    """One line: did long samples reach training as often as a synchronous run would train them?"""
    share = summary.get("length_longest_decile_share")
    if share is None:
        return "length bias: n/a"
    f = lambda k: "n/a" if summary.get(k) is None else f"{summary[k]:.1f}"  # noqa: E731
    return (f"length bias: trained response length mean {f('length_trained_mean')} / p90 {f('length_trained_p90')} vs "
            f"a synchronous run on the same prompts {f('length_sync_mean')} / {f('length_sync_p90')}; its longest "
            f"decile reaches training {share:.2f}x as often (1 = as often as synchronously)")


def log_run_summary(run_dir: str, metrics_path: str, args, restarts: dict[str, int] | None = None) -> dict:
    """summary.json and its log lines. `restarts`: the run's restarts by part, counted to the end (one found
    after the last metrics row, e.g. in the last checkpoint's save, is in no row)."""
    summary = summarize(read_metrics(metrics_path)) if os.path.isfile(metrics_path) else {}
    summary["restarts"] = dict(restarts or {})
    summary["metrics"] = metrics_path
    summary["checkpoint"] = os.path.abspath(args.save) if args.save else None
    summary["max_staleness"] = args.max_staleness
    gains = first_to_last(run_dir)  # per eval set: first eval -> last, the same prompts (eval_scores.jsonl)
    summary["eval_gains"] = gains
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    def fmt(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        "==== run summary ====",
        f"steps: {summary.get('steps', 0)}",
        f"eval accuracy: {fmt(summary.get('eval_accuracy_first'))} -> {fmt(summary.get('eval_accuracy_last'))}",
        *(line for g in gains for line in (accuracy_line(g), gain_line(g, "eval gain" if len(gains) == 1
                                                                         else f"eval gain [{g['set']}]"))),
        f"reward (first -> last quarter of steps): {fmt(summary.get('reward_first_quarter'))} -> {fmt(summary.get('reward_last_quarter'))}",
        f"rollout tokens/s: {fmt(summary.get('rollout_tokens_per_s'), '.1f')}",
        staleness_line(summary, args),
        length_line(summary),
        guard_line(summary, args),
    ]
    if "tool_call_rate_first_quarter" in summary:
        lines += [
            f"tool-call rate, eval (model turns ending in a call): {fmt(summary['eval_tool_call_rate_first'])} -> "
            f"{fmt(summary['eval_tool_call_rate_last'])}; tool calls per sample, eval: "
            f"{fmt(summary['eval_tool_calls_per_sample_first'], '.2f')} -> {fmt(summary['eval_tool_calls_per_sample_last'], '.2f')}",
            f"tool-call rate, rollout (first -> last quarter of steps): {fmt(summary['tool_call_rate_first_quarter'])} "
            f"-> {fmt(summary['tool_call_rate_last_quarter'])}; tool failures: {summary['tool_failures']:.0f}",
        ]
    if any(summary["restarts"].values()):
        lines.append("restarts: " + ", ".join(f"{part} {n}" for part, n in summary["restarts"].items()))
    lines += [
        f"metrics: {metrics_path}",
        f"checkpoint: {summary['checkpoint'] or 'none (--save not set)'}",
    ]
    for line in lines:
        logger.info(line)
    return summary
