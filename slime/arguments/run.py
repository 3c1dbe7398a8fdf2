"""The run's state and reports: checkpoints (--load, --save, --ref-load), the run directory and wandb."""

from __future__ import annotations

import argparse
import os
import time

from slime.arguments.base import Args, _here, _require, make_absolute


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument("--load", type=str, default=None, help="checkpoint directory to resume from")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="with --load: resume from this rollout id's checkpoint (iter_N) instead of the newest")
    g.add_argument("--save", type=str, default=None, help="checkpoint directory (every --save-interval steps and after the last)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ref-load", type=str, default=None,
                   help="reference model (default: --hf-checkpoint); with --train-backend megatron a torch_dist "
                        "checkpoint (tools/convert_hf_to_torch_dist.py) or a HF directory, which is also the "
                        "actor's starting point when --load has no checkpoint (as in slime)")
    # Megatron-LM's names; a SIGTERM or SIGINT stops the same way (docs/faults.md)
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop this many minutes after the start (the rollout halted, its unfinished samples parked), "
                        "checkpoint (with --save) and exit 0: set it below a scheduler's time limit and --load resumes")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop after every step whose number (counted from 1, across resumes) is a multiple of this, "
                        "checkpointed (with --save); exit 0")

    g = p.add_argument_group("logging")
    g.add_argument("--use-wandb", action=argparse.BooleanOptionalAction, default=True,
                   help="also log to wandb, offline unless --wandb-mode online (--no-use-wandb: metrics.jsonl only)")
    g.add_argument("--wandb-project", type=str, default="slime-april")
    g.add_argument("--wandb-group", type=str, default=None)
    g.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=None,
                   help="default: online with --wandb-key, else offline")
    g.add_argument("--wandb-key", type=str, default=None,
                   help="upstream slime's: the W&B API key this run logs in with (online by default then); prefer "
                        "WANDB_API_KEY in the environment: a flag's value shows in the process list")
    g.add_argument("--run-dir", type=str, default=None,
                   help="metrics.jsonl, traces, logs (default: runs/<date-time> under the working directory)")


def fill_defaults(a: Args) -> None:
    if a.run_dir is None:
        a.run_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    make_absolute(a, "load", "save", "ref_load", "run_dir")
    if a.wandb_mode is None:
        a.wandb_mode = "online" if a.wandb_key else "offline"


def check(a: Args, entry: str) -> None:
    _require(a.save_interval is None or (a.save_interval > 0 and a.save is not None), "--save-interval",
             "must be > 0 and needs --save")
    _require(a.load is None or _here(a, os.path.isdir(a.load)) or a.save == a.load, "--load",
             f"{a.load!r} is not a directory")
    _require(a.exit_duration_in_mins is None or a.exit_duration_in_mins > 0, "--exit-duration-in-mins", "must be > 0")
    _require(a.exit_interval is None or a.exit_interval > 0, "--exit-interval", "must be > 0")
    _require(a.ckpt_step is None or (a.load is not None and a.ckpt_step >= 0), "--ckpt-step", "must be >= 0 and needs --load")
