"""Per-prompt eval scores (`<run_dir>/eval_scores.jsonl`) and what they say with their noise: accuracy with a
95% interval, and the gain between two evals of the same prompts with a paired 95% interval (pairing removes the
prompts' own spread)."""

from __future__ import annotations

import hashlib
import json
import math
import os

EVAL_SCORES = "eval_scores.jsonl"
Z95 = 1.959963984540054


def prompt_scores(groups, reward_key: str | None = None) -> list[float | None]:
    """Each group's share of rewarded samples with reward > 0; None for a group with no rewarded sample."""
    from slime.utils.types import Status

    out: list[float | None] = []
    for group in groups:
        rewards = [r for s in group if s.status is not Status.FAILED and (r := s.scalar_reward(reward_key)) is not None]
        out.append(sum(1 for r in rewards if r > 0) / len(rewards) if rewards else None)
    return out


def prompts_digest(groups) -> str:
    """Names the prompts of an eval set (in order): two evals are paired only over the same prompts."""
    h = hashlib.sha256()
    for group in groups:
        h.update(json.dumps(group[0].prompt, sort_keys=True, default=str).encode() + b"\0")
    return h.hexdigest()[:16]


def write_eval_scores(run_dir: str, step: int, name: str, groups, reward_key: str | None = None) -> None:
    row = {"step": step, "set": name, "prompts": prompts_digest(groups), "scores": prompt_scores(groups, reward_key)}
    with open(os.path.join(run_dir, EVAL_SCORES), "a") as f:
        f.write(json.dumps(row) + "\n")


def read_eval_scores(run_dir: str) -> dict[str, list[dict]]:
    """The rows of `<run_dir>/eval_scores.jsonl` by eval set, in step order ({} when there is none)."""
    path = os.path.join(run_dir, EVAL_SCORES)
    if not os.path.isfile(path):
        return {}
    sets: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                sets.setdefault(row["set"], []).append(row)
    return {k: sorted(v, key=lambda r: r["step"]) for k, v in sets.items()}


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its 95% interval (normal approximation); needs at least one value."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval: no values")
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = Z95 * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def accuracy_interval(scores: list[float | None]) -> tuple[float, float, float]:
    """Accuracy over the scored prompts with its 95% interval, clipped to [0, 1]."""
    mean, lo, hi = mean_interval([s for s in scores if s is not None])
    return mean, max(0.0, lo), min(1.0, hi)


def paired_gain(before: dict, after: dict) -> dict:
    """The gain from eval row `before` to eval row `after` of the same set, with its paired 95% interval."""
    if before["prompts"] != after["prompts"] or len(before["scores"]) != len(after["scores"]):
        raise ValueError(f"eval set {before['set']!r}: steps {before['step']} and {after['step']} evaluated different "
                         "prompts; no paired gain")
    pairs = [(b, a) for b, a in zip(before["scores"], after["scores"]) if b is not None and a is not None]
    if not pairs:
        raise ValueError(f"eval set {before['set']!r}: no prompt scored at both steps {before['step']} and {after['step']}")
    gain, lo, hi = mean_interval([a - b for b, a in pairs])
    return {"set": before["set"], "from_step": before["step"], "to_step": after["step"], "prompts": len(pairs),
            "before": list(accuracy_interval([b for b, _ in pairs])),
            "after": list(accuracy_interval([a for _, a in pairs])), "gain": gain, "gain_interval": [lo, hi]}


def first_to_last(run_dir: str) -> list[dict]:
    """For every eval set evaluated at least twice: the paired gain from its first eval to its last."""
    return [paired_gain(rows[0], rows[-1]) for rows in read_eval_scores(run_dir).values() if len(rows) > 1]


def gain_line(g: dict, label: str = "eval gain") -> str:
    """`eval gain: +0.123 (95% interval +0.050 .. +0.190)`."""
    lo, hi = g["gain_interval"]
    return f"{label}: {g['gain']:+.3f} (95% interval {lo:+.3f} .. {hi:+.3f})"


def accuracy_line(g: dict) -> str:
    (b, blo, bhi), (a, alo, ahi) = g["before"], g["after"]
    return (f"eval accuracy [{g['set']}] step {g['from_step']} -> {g['to_step']}, {g['prompts']} prompts: "
            f"{b:.3f} (95% interval {blo:.3f} .. {bhi:.3f}) -> {a:.3f} (95% interval {alo:.3f} .. {ahi:.3f})")
