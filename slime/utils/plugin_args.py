"""The `args` a plugin gets: one mutable copy of the run's frozen flags per process.

Upstream plugins keep state on `args`; what they write is shared between plugin calls in this process but never
reaches the validated flags (our own code reads `run_flags(args)`)."""

from __future__ import annotations

import argparse
from typing import Any


class PluginArgs(argparse.Namespace):
    """The run's flags as plugins see them (writable); `run_flags(view)` is the validated `Args` behind it."""

    def __init__(self, flags: Any):
        super().__init__(**{k: v for k, v in vars(flags).items() if not k.startswith("_")})
        self.__dict__["_run_flags"] = flags


def plugin_args(args: Any) -> Any:
    """The process's one plugin view of `args` (a frozen `Args`); any other namespace is returned as it is."""
    for_plugins = getattr(type(args), "for_plugins", None)
    return for_plugins(args) if for_plugins is not None else args


def run_flags(args: Any) -> Any:
    """The validated flags behind a plugin view (or `args` itself): what our own code reads."""
    return args.__dict__.get("_run_flags", args) if isinstance(args, PluginArgs) else args
