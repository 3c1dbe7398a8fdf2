"""What every flag group of slime/arguments/ shares: the parsed flags (`Args`), the error a broken rule raises,
`_require` (a rule that names its flag) and the helpers of path and device defaults."""

from __future__ import annotations

import argparse
import os
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
        """The one writable copy of these flags every plugin in this process gets; it never changes these."""
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
        """A new frozen copy with some flags changed (tests and tools); derived values are not recomputed."""
        values = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise AttributeError(f"Args.replace: no flag named {unknown[0]!r} (misspelt?)")
        values.update(changes)
        return Args(**values)._freeze()


def _require(cond: bool, flag: str, rule: str) -> None:
    if not cond:
        raise ArgumentError(f"{flag}: {rule}")


def _here(a: Args, exists: bool) -> bool:
    """A path check a dry run passes (the path may live only on the GPU machines; the dry run lists those)."""
    return exists or a.dry_run is not None


def flag_name(dest: str) -> str:
    """`rollout_batch_size` -> `--rollout-batch-size`: how an error names a flag."""
    return "--" + dest.replace("_", "-")


def make_absolute(a: Args, *names: str) -> None:
    """Path flags made absolute at parse time, so every process of the run reads the same path."""
    for name in names:
        if getattr(a, name) is not None:
            setattr(a, name, absolute(getattr(a, name)))


def absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def on_gpus(a: Args) -> bool:
    """Whether the trainer runs on GPUs: CUDA (or ROCm) here, or a dry run of a GPU command line."""
    if a.dry_run is not None:
        return True
    import torch

    return torch.cuda.is_available()
