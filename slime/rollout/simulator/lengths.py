"""Response lengths for the rollout simulator: parametric (`LogNormalLengths`, `ParetoLengths`), empirical
(`EmpiricalLengths`, `lengths_from_run`), or replayed (`ReplayLengths`). `sample_group(rng, n)` draws one prompt
group, every length in [1, cap]. `kaplan_meier` keeps parked samples as right-censored (they are the long ones)."""

from __future__ import annotations

import json
import math
import os
import random
from typing import Sequence

from slime.rollout import length_bias


def _clip(x: float, cap: int) -> int:
    return max(1, min(cap, int(round(x))))


class LogNormalLengths:
    def __init__(self, median: float, sigma: float, cap: int, group_corr: float = 0.0, prompt_len: int = 128):
        if median <= 0 or sigma < 0 or cap < 1 or not 0 <= group_corr <= 1:
            raise ValueError(f"LogNormalLengths: need median > 0, sigma >= 0, cap >= 1, 0 <= group_corr <= 1 "
                             f"(got {median}, {sigma}, {cap}, {group_corr})")
        self.median, self.sigma, self.cap, self.group_corr, self.prompt_len = median, sigma, cap, group_corr, prompt_len

    def sample_group(self, rng, n):
        mu = math.log(self.median)
        common = rng.gauss(0.0, 1.0) * math.sqrt(self.group_corr)
        own = math.sqrt(1.0 - self.group_corr)
        return self.prompt_len, [_clip(math.exp(mu + self.sigma * (common + own * rng.gauss(0.0, 1.0))), self.cap)
                                 for _ in range(n)]

    def truncated_fraction(self) -> float:
        z = (math.log(self.cap) - math.log(self.median)) / self.sigma if self.sigma > 0 else math.inf
        return 0.5 * math.erfc(z / math.sqrt(2))

    def describe(self):
        return (f"log-normal response lengths: median {self.median:.0f}, sigma {self.sigma}, cap {self.cap} "
                f"({100 * self.truncated_fraction():.1f}% truncated), within-group correlation {self.group_corr}, "
                f"prompt {self.prompt_len} tokens")


# The APRIL paper's response lengths as we assume them (it gives none): Qwen3-4B on DAPO-Math-17k, log-normal,
# median 6,000, sigma 0.8, half of the log-length variance shared by a prompt's samples, 200-token prompts.
PAPER_LENGTHS = dict(median=6000, sigma=0.8, corr=0.5, prompt=200)
PAPER_CAP = 16384


def paper_lengths(cap: int = PAPER_CAP, prompt_len: int = PAPER_LENGTHS["prompt"]) -> LogNormalLengths:
    """`PAPER_LENGTHS` scaled to a cap of `cap` tokens (median and cap shrink together: the same shape, shorter)."""
    return LogNormalLengths(PAPER_LENGTHS["median"] * cap / PAPER_CAP, PAPER_LENGTHS["sigma"], cap,
                            PAPER_LENGTHS["corr"], prompt_len)


class ParetoLengths:
    """scale x q, q = min(cap_steps, ceil(X)), X ~ Pareto(x_m=1, alpha) (subtract_chain.sample_steps)."""

    def __init__(self, alpha: float = 1.0, scale: int = 1, cap_steps: int = 64, prompt_len: int = 6):
        if alpha <= 0 or scale < 1 or cap_steps < 1:
            raise ValueError(f"ParetoLengths: need alpha > 0, scale >= 1, cap_steps >= 1 (got {alpha}, {scale}, {cap_steps})")
        self.alpha, self.scale, self.cap_steps, self.prompt_len = alpha, scale, cap_steps, prompt_len
        self.cap = scale * cap_steps

    def draw(self, rng) -> int:
        u = 1.0 - rng.random()
        return self.scale * max(1, min(self.cap_steps, math.ceil(u ** (-1.0 / self.alpha))))

    def sample_group(self, rng, n):
        return self.prompt_len, [self.draw(rng) for _ in range(n)]

    def describe(self):
        return (f"truncated Pareto response lengths: {self.scale} x min({self.cap_steps}, ceil(Pareto(1, {self.alpha}))) "
                f"tokens (max {self.cap}), prompt {self.prompt_len} tokens")


class EmpiricalLengths:
    """Draws whole observed groups or, `per_sample`, each sample from the pooled lengths."""

    def __init__(self, groups: Sequence[Sequence[int]], cap: int, prompt_lens: Sequence[int] = (16,),
                 per_sample: bool = False, weights: Sequence[float] | None = None, source: str = "observations"):
        groups = [list(g) for g in groups if len(g)]
        if not groups:
            raise ValueError(f"EmpiricalLengths: no lengths in {source}")
        self.groups, self.cap, self.prompt_lens = groups, int(cap), list(prompt_lens) or [16]
        self.per_sample, self.source = per_sample, source
        self.pooled = [x for g in groups for x in g]
        self.weights = list(weights) if weights is not None else None
        if self.weights is not None and len(self.weights) != len(self.pooled):
            raise ValueError("EmpiricalLengths: one weight per pooled length")

    def _one(self, rng) -> int:
        if self.weights is None:
            return _clip(rng.choice(self.pooled), self.cap)
        return _clip(rng.choices(self.pooled, weights=self.weights, k=1)[0], self.cap)

    def sample_group(self, rng, n):
        prompt = rng.choice(self.prompt_lens)
        if self.per_sample or self.weights is not None:
            return prompt, [self._one(rng) for _ in range(n)]
        g = rng.choice(self.groups)
        if len(g) == n:
            return prompt, [_clip(x, self.cap) for x in g]
        return prompt, [_clip(rng.choice(g), self.cap) for _ in range(n)]

    def mean(self) -> float:
        if self.weights is None:
            return sum(self.pooled) / len(self.pooled)
        return sum(x * w for x, w in zip(self.pooled, self.weights)) / sum(self.weights)

    def quantile(self, q: float) -> int:
        w = self.weights or [1.0] * len(self.pooled)
        pairs = sorted(zip(self.pooled, w))
        total, acc = sum(w), 0.0
        for x, wi in pairs:
            acc += wi
            if acc >= q * total:
                return x
        return pairs[-1][0]

    def describe(self):
        what = "distinct lengths" if self.weights is not None else f"{len(self.groups)} groups, {len(self.pooled)} samples"
        return (f"empirical response lengths from {self.source}: {what}, mean {self.mean():.1f}, "
                f"median {self.quantile(0.5)}, p90 {self.quantile(0.9)}, max {max(self.pooled)} (cap {self.cap})")


class ReplayLengths:
    """The given groups in order (prompt_len, [lengths]); raises when they run out."""

    def __init__(self, groups: Sequence[tuple[int, Sequence[int]]], cap: int):
        self.groups, self.cap, self.next = [(p, list(g)) for p, g in groups], cap, 0

    def sample_group(self, rng, n):
        if self.next >= len(self.groups):
            raise IndexError(f"ReplayLengths: all {len(self.groups)} groups used")
        p, g = self.groups[self.next]
        self.next += 1
        if len(g) != n:
            raise ValueError(f"ReplayLengths: group {self.next - 1} has {len(g)} samples, asked for {n}")
        return p, g

    def describe(self):
        return f"replayed workload: {len(self.groups)} groups (cap {self.cap})"


def kaplan_meier(finished: Sequence[int], unfinished: Sequence[int], cap: int,
                 prompt_lens: Sequence[int] = (16,)) -> EmpiricalLengths:
    """Length distribution from finished and right-censored lengths; the mass left goes to the cap."""
    pairs = length_bias.kaplan_meier(finished, unfinished, cap)
    return EmpiricalLengths([[x for x, _ in pairs]], cap, prompt_lens, weights=[w for _, w in pairs],
                            source=f"{len(finished)} finished + {len(unfinished)} censored samples")


def read_trace(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "rollout_trace.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no rollout trace (was the run made with --run-dir?)")
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is not JSON ({e})") from e
    return out


def lengths_from_run(run_dir: str, cap: int | None = None, censored: bool = True) -> EmpiricalLengths:
    """Response lengths in a run's trace (with `censored`, unfinished ones through `kaplan_meier`)."""
    records = [r for r in read_trace(run_dir) if "finished_lengths" in r]
    if not records:
        raise ValueError(f"{run_dir}/rollout_trace.jsonl: no step records with finished_lengths "
                         "(the run predates length tracing)")
    groups = [g for r in records for g in r["finished_lengths"]]
    cap = cap or max(int(r.get("max_response_len") or 0) for r in records) or max(max(g) for g in groups)
    prompts = [int(r["prompt_len"]) for r in records if r.get("prompt_len")] or [16]
    last_unfinished = records[-1].get("unfinished_lengths", []) if censored else []
    if last_unfinished:
        # only the samples still unfinished at the end are censored; earlier ones finished later
        km = kaplan_meier([x for g in groups for x in g], last_unfinished, cap, prompts)
        km.source = f"{run_dir} ({km.source})"
        return km
    return EmpiricalLengths(groups, cap, prompts, source=run_dir)
