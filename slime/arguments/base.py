"""What every part of slime/arguments/ shares: the parsed flags (`Args`), the error a broken rule raises, the
built-in plugins' paths, and `_require` (a rule that names its flag)."""

from __future__ import annotations

import argparse
from typing import Any


class ArgumentError(ValueError):
    """A flag value breaks a rule; the message names the flag and the rule."""


class Args(argparse.Namespace):
    """The parsed flags, read-only once `parse_args` returns."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"args are read-only after parsing (tried to set {name!r})")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"args are read-only after parsing (tried to delete {name!r})")

    def for_plugins(self):
        """The one writable copy of these flags that every plugin in this process gets (slime/utils/plugin_args.py);
        what plugins write to it never changes these."""
        view = self.__dict__.get("_plugin_view")
        if view is None:
            from slime.utils.plugin_args import PluginArgs

            view = self.__dict__["_plugin_view"] = PluginArgs(self)
        return view

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_plugin_view"}  # each process makes its own

    def _freeze(self) -> "Args":
        super().__setattr__("_frozen", True)
        return self

    def replace(self, **changes: Any) -> "Args":
        """A new frozen copy with some values changed (for tests and tools); only existing flags can change.

        Derived values (`num_engines`, `eval_datasets`, defaults filled from other flags) are not
        recomputed: change them too when the flags they come from change.
        """
        values = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise AttributeError(f"Args.replace: no flag named {unknown[0]!r} (misspelt?)")
        values.update(changes)
        return Args(**values)._freeze()


# the built-in APRIL rollout (--rollout-function-path's default); stream mode always runs it
BUILTIN_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


# the built-in multi-turn generate that --agent-env runs
BUILTIN_MULTI_TURN_GENERATE = "slime.rollout.multi_turn.generate"


# multi-turn flags that mean nothing without --agent-env, and their defaults with it
_AGENT_DEFAULTS = {"max_turns": 16, "tool_timeout": 30.0, "tool_workers": 4, "tool_max_output_chars": 4096,
                   "tool_memory_mb": 2048}


def _require(cond: bool, flag: str, rule: str) -> None:
    if not cond:
        raise ArgumentError(f"{flag}: {rule}")


def _here(a: Args, exists: bool) -> bool:
    """A path check; a dry run passes it (the path may live only on the GPU machines: the dry run lists what is
    not on this one)."""
    return exists or a.dry_run is not None
