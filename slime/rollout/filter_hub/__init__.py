"""Dynamic-sampling filters: `def f(args, samples) -> DynamicFilterOutput` (`--dynamic-sampling-filter-path`)."""

from __future__ import annotations

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.misc import load_function

__all__ = ["DynamicFilterOutput", "call_dynamic_filter"]


def call_dynamic_filter(path: str, args, samples) -> DynamicFilterOutput:
    """Load the filter at dotted `path`, apply it to one finished group, check it kept the contract."""
    out = load_function(path)(args, samples)
    if not isinstance(out, DynamicFilterOutput):
        raise TypeError(
            f"--dynamic-sampling-filter-path {path} returned {type(out).__name__}; it must return "
            "slime.rollout.filter_hub.base_types.DynamicFilterOutput(keep, reason)"
        )
    return out
