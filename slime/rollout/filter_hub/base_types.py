"""What a dynamic-sampling filter returns (`--dynamic-sampling-filter-path`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DynamicFilterOutput:
    """`keep`: whether the finished group goes to training; `reason`: why not (logged and counted)."""

    keep: bool
    reason: str | None = None
