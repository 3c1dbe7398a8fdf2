"""Dynamic-sampling filters (`--dynamic-sampling-filter-path`), upstream slime's contract:
`def f(args, samples) -> DynamicFilterOutput | bool` (a plain bool is `DynamicFilterOutput(keep=...)`, as upstream
reads it; a `keep` that is a one-element tensor or numpy bool is read as its truth value)."""

from __future__ import annotations

from typing import Any, Callable

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.misc import load_function
from slime.utils.plugin_args import plugin_args

__all__ = ["DynamicFilterOutput", "as_filter_output", "call_dynamic_filter", "group_filter", "load_dynamic_filter"]


def _truth(value: Any) -> bool | None:
    """A bool, a numpy bool or a one-element boolean tensor / array as a bool; None for anything else."""
    if isinstance(value, bool):
        return value
    if "bool" in str(getattr(value, "dtype", "")):
        size = value.numel() if hasattr(value, "numel") else getattr(value, "size", 1)
        if size == 1:
            return bool(value)
    return None


def as_filter_output(out: Any, path: str) -> DynamicFilterOutput:
    """A filter's return value as a `DynamicFilterOutput`; anything else is refused naming the filter."""
    if isinstance(out, DynamicFilterOutput):
        keep = _truth(out.keep)
        if keep is None:
            raise TypeError(f"--dynamic-sampling-filter-path {path} returned DynamicFilterOutput(keep={out.keep!r}); "
                            "keep must be a bool")
        return DynamicFilterOutput(keep, out.reason, bool(out.keep_when_insufficient))
    keep = _truth(out)
    if keep is None:
        raise TypeError(f"--dynamic-sampling-filter-path {path} returned {type(out).__name__}; it must return "
                        "slime.rollout.filter_hub.base_types.DynamicFilterOutput(keep, reason) or a bool")
    return DynamicFilterOutput(keep)


def load_dynamic_filter(path: str) -> Callable[[Any, list], DynamicFilterOutput]:
    """The filter at dotted `path`, its result checked and read as a `DynamicFilterOutput`."""
    fn = load_function(path)
    return lambda args, samples: as_filter_output(fn(args, samples), path)


def call_dynamic_filter(path: str, args, samples) -> DynamicFilterOutput:
    """Load the filter at dotted `path` and apply it to one finished group."""
    return load_dynamic_filter(path)(args, samples)


def group_filter(args) -> Callable[[list, Any], str | None] | None:
    """`--dynamic-sampling-filter-path` as the step's filter: (group, record) -> why it is dropped, or None; a
    `keep_when_insufficient` rejection is kept while the step is short of candidates."""
    path = args.dynamic_sampling_filter_path
    if not path:
        return None
    fn, view = load_dynamic_filter(path), plugin_args(args)

    def reason(samples: list, step) -> str | None:
        out = fn(view, samples)
        candidates = len(step.accepted) + len(step.failed) + len(step.open_groups())
        return (out.reason or "filtered") if out.drops(candidates, step.target) else None

    return reason
