"""The run's restart budget (`--use-fault-tolerance`, `--max-engine-restarts N`): engine, router, trainer and
buffer-actor restarts spend from one budget; once spent the run stops, naming what failed last."""

from __future__ import annotations

from collections import Counter

PARTS = ("engine", "router", "trainer", "buffer")
TOGETHER = "engines, the router, the trainer and the buffer together"  # what the budget counts (messages)


class RestartBudget:
    def __init__(self, limit: int):
        self.limit = int(limit)
        self.counts: Counter = Counter()

    @property
    def used(self) -> int:
        return sum(self.counts.values())

    def spend(self, part: str) -> bool:
        """Count one restart of `part`; False (nothing counted) when the budget is spent."""
        if part not in PARTS:
            raise ValueError(f"restart budget: unknown part {part!r}; expected one of {PARTS}")
        if self.used >= self.limit:
            return False
        self.counts[part] += 1
        return True

    def progress(self) -> str:
        """`used/limit`, for the log line of each restart."""
        return f"{self.used}/{self.limit}"

    def metrics(self) -> dict[str, float]:
        """Restarts so far by part (`engine/restarts`: the engines' count under its first name)."""
        return {"engine/restarts": float(self.counts["engine"]),
                **{f"restarts/{p}": float(self.counts[p]) for p in PARTS}}
