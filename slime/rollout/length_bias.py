"""Length bias: does what reaches training have the lengths a synchronous run would have trained?

Per step, response lengths of what was trained, of what the engines finished, and of what a synchronous run would
have trained (Kaplan-Meier over first attempts, restarted samples right-censored); docs/metrics.md."""

from __future__ import annotations

from collections import Counter
from typing import Sequence

# Sample.metadata: the response length at the sample's first restart by the staleness cap (a censored length)
CUT_KEY = "first_attempt_cut_at"


def _quantile(sorted_xs: list[int], q: float) -> float:
    return float(sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))])


def length_summary(lengths: list[int], prefix: str) -> dict[str, float]:
    """`{prefix}_mean`, `{prefix}_p50`, `{prefix}_p90` of `lengths` (none when empty)."""
    if not lengths:
        return {}
    xs = sorted(lengths)
    return {f"{prefix}_mean": sum(xs) / len(xs), f"{prefix}_p50": _quantile(xs, 0.5), f"{prefix}_p90": _quantile(xs, 0.9)}


def kaplan_meier(finished: Sequence[int], censored: Sequence[int], cap: int) -> list[tuple[int, float]]:
    """(length, probability) pairs of the length distribution behind finished lengths and right-censored ones (at
    least that long); the mass left beyond the last finished length goes to `cap`."""
    if not finished and not censored:
        raise ValueError("kaplan_meier: no observations")
    events, cut = Counter(int(x) for x in finished), Counter(int(x) for x in censored)
    at_risk, surv, out = len(finished) + len(censored), 1.0, []
    for t in sorted(set(events) | set(cut)):
        d = events.get(t, 0)
        if d and at_risk > 0:
            p = surv * d / at_risk
            out.append((min(t, cap), p))
            surv -= p
        at_risk -= d + cut.get(t, 0)
    if surv > 1e-12:
        out.append((cap, surv))
    return out


class Distribution:
    """Weighted lengths: mean, quantiles, the share at or beyond a length."""

    def __init__(self, pairs: list[tuple[int, float]]):
        self.pairs = sorted(pairs)
        self.total = sum(w for _, w in self.pairs)

    def mean(self) -> float:
        return sum(x * w for x, w in self.pairs) / self.total

    def quantile(self, q: float) -> int:
        acc = 0.0
        for x, w in self.pairs:
            acc += w
            if acc >= q * self.total - 1e-12:
                return x
        return self.pairs[-1][0]

    def share_at_least(self, length: int) -> float:
        return sum(w for x, w in self.pairs if x >= length) / self.total


def sync_estimate(samples) -> Distribution | None:
    """The synchronous run's length distribution on `samples`' prompts, from their first attempts (above)."""
    finished = [s.response_length for s in samples if CUT_KEY not in s.metadata]
    cut = [int(s.metadata[CUT_KEY]) for s in samples if CUT_KEY in s.metadata]
    if not finished and not cut:
        return None
    return Distribution(kaplan_meier(finished, cut, max(finished + cut)))


def length_bias_metrics(trained, generated=None, dropped=()) -> dict[str, float]:
    """The `length/` metrics of one step: its `trained` samples, the samples of groups the staleness cap `dropped`
    (on the prompts a synchronous run would have trained too) and, when known, its `generated` ones."""
    trained = list(trained)
    out = {f"length/{k}": v for k, v in length_summary([s.response_length for s in trained], "trained").items()}
    if generated is not None:
        out.update({f"length/{k}": v for k, v in length_summary([s.response_length for s in generated],
                                                               "generated").items()})
    sync = sync_estimate(trained + list(dropped))
    if sync is None or not trained:
        return out
    p90 = sync.quantile(0.9)
    out.update({"length/sync_mean": sync.mean(), "length/sync_p50": float(sync.quantile(0.5)),
                "length/sync_p90": float(p90)})
    trained_beyond = sum(s.response_length >= p90 for s in trained) / len(trained)
    out["length/longest_decile_share"] = trained_beyond / sync.share_at_least(p90)
    return out


__all__ = ["Distribution", "kaplan_meier", "length_bias_metrics", "length_summary", "sync_estimate"]
