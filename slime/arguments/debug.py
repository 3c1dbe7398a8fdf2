"""Debugging a run by halves (rollout only, training only, replaying saved steps) and the dry run of a GPU command
line (slime/dry_run.py)."""

from __future__ import annotations

import argparse

from slime.arguments.base import Args, _require, flag_name, make_absolute

# the cards a dry run can size its memory estimate for (slime/rollout/simulator/gpu_presets.py's datasheets)
DRY_RUN_GPUS = ("h100", "h200", "mi300x")


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true")
    g.add_argument("--debug-train-only", action="store_true")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", type=str, default=None, help="path template with {rollout_id}")

    g = p.add_argument_group("dry run (docs/gpu.md: the first thing to run before spending GPUs)")
    g.add_argument("--dry-run", nargs="?", const="h100", choices=DRY_RUN_GPUS, default=None,
                   help="check the whole command line as it would run on GPUs of this kind (h100 when not named) and "
                        "exit: flags, the model's config, the --sglang-* / --router-* pass-through flags, the plugins' "
                        "imports and signatures; print the effective settings, the placement and an estimate of "
                        "memory per GPU. Starts no Ray, engine or trainer; paths not on this machine are listed")


def fill_defaults(a: Args) -> None:
    make_absolute(a, "save_debug_rollout_data", "load_debug_rollout_data")


def check(a: Args, entry: str) -> None:
    _require(not (a.debug_rollout_only and a.debug_train_only), "--debug-rollout-only",
             "cannot be combined with --debug-train-only")
    for name in ("load_debug_rollout_data", "save_debug_rollout_data"):
        path = getattr(a, name)
        _require(path is None or "{rollout_id}" in path, flag_name(name),
                 "must contain {rollout_id} in its path template")
    if entry == "train_async.py":
        for value, flag in ((a.debug_rollout_only, "--debug-rollout-only"), (a.debug_train_only, "--debug-train-only"),
                            (a.load_debug_rollout_data, "--load-debug-rollout-data")):
            _require(not value, flag, "has no rollout and training to overlap; use train.py")
