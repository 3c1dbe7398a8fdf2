"""What a dynamic-sampling filter returns (`--dynamic-sampling-filter-path`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """`keep`, `reason` (why not), and upstream's `keep_when_insufficient` (kept when the step runs short)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False

    def drops(self, candidates: int, target: int | None) -> bool:
        """Whether the group is dropped, `candidates` being the step's groups accepted or still in play (this one
        included) and `target` the groups it needs (None: no target, as in stream mode's segments)."""
        if self.keep:
            return False
        return not (self.keep_when_insufficient and target is not None and candidates <= target)
