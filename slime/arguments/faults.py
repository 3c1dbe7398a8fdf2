"""Fault tolerance: the engines' health checks (always on) and restarts of engines, the router, the trainer and the
buffer actor (--use-fault-tolerance); docs/faults.md."""

from __future__ import annotations

import argparse

from slime.arguments.base import Args, _require


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("fault tolerance (an engine watchdog always runs; restarts need --use-fault-tolerance)")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="restart an engine that dies or freezes during a rollout (re-sync the current weights, resume "
                        "its parked samples), the router (same port, engines registered again) and a trainer that "
                        "dies or runs out of memory, or the buffer actor (from the last checkpoint, the other parts "
                        "kept, what changed it since replayed); without it such a failure stops the run, naming the "
                        "part")
    g.add_argument("--rollout-health-check-interval", type=float, default=10.0,
                   help="seconds between GET /health_generate checks of every engine while a step runs "
                        "(0: HTTP checks off; dead or stopped engine processes are still noticed within 1 s)")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0,
                   help="seconds an engine may take to answer /health_generate before it counts as frozen")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0,
                   help="seconds before the first HTTP health check of a step (slow first compilations)")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="restarts allowed in a run (--use-fault-tolerance), of engines, the router, the trainer and "
                        "the buffer actor together; one more failure checkpoints (with --save, where it can) and "
                        "stops the run")
    g.add_argument("--max-consecutive-empty-steps", type=int, default=3,
                   help="stop the run when this many steps in a row have no trainable sample (every group failed); "
                        "such steps are skipped (no update, no version bump) and counted")


def check(a: Args, entry: str) -> None:
    _require(a.rollout_health_check_interval >= 0, "--rollout-health-check-interval", "must be >= 0 (0: off)")
    _require(a.rollout_health_check_timeout > 0, "--rollout-health-check-timeout", "must be > 0")
    _require(a.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait", "must be >= 0")
    _require(a.max_engine_restarts >= 0, "--max-engine-restarts", "must be >= 0")
    _require(a.max_consecutive_empty_steps > 0, "--max-consecutive-empty-steps", "must be > 0")
    _require(not a.use_fault_tolerance or entry != "train_async.py", "--use-fault-tolerance", "train_async.py does not "
             "restart engines under a running rollout yet (an engine fault stops the run, naming the engine); use "
             "train.py to restart them")
