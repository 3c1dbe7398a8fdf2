"""The `args` a plugin gets: a mutable copy of the run's flags, one per process.

Upstream slime hands every plugin (rollout function, custom generate, reward, filters) its one `args` namespace,
and plugins keep state on it (`args.tokenizer = ...`, `args.rollout_max_context_len = ...` for an evaluation,
counters). Here the run's flags are frozen once validated (`slime.arguments.Args`), so plugins get
`plugin_args(args)`: a `PluginArgs` copy of them that any plugin may write to, the same object for every plugin
call in this process (state one plugin keeps on it is there for the next call and for the other plugins). What a
plugin writes never reaches the validated flags: our own code reads `run_flags(args)`. The partial-rollout
buffer (`--buffer-filter-path`) lives in its own process, so its filter sees its own copy.
"""

from __future__ import annotations

import argparse
from typing import Any


class PluginArgs(argparse.Namespace):
    """The run's flags as plugins see them (writable); `run_flags(view)` is the validated `Args` behind it."""

    def __init__(self, flags: Any):
        super().__init__(**{k: v for k, v in vars(flags).items() if not k.startswith("_")})
        self.__dict__["_run_flags"] = flags


def plugin_args(args: Any) -> Any:
    """The process's one plugin view of `args` (a frozen `Args`, or already a view); any other namespace (tests,
    tools) is mutable already and returned as it is."""
    for_plugins = getattr(type(args), "for_plugins", None)
    return for_plugins(args) if for_plugins is not None else args


def run_flags(args: Any) -> Any:
    """The validated flags behind a plugin view (or `args` itself): what our own code reads."""
    return args.__dict__.get("_run_flags", args) if isinstance(args, PluginArgs) else args
