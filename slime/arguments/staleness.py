"""Staleness: how many policy versions a resumed token may lag behind the policy it trains, and (train_async.py)
how far the rollout may run ahead of the trainer."""

from __future__ import annotations

import argparse

from slime.arguments.base import ArgumentError, Args, _require
from slime.rollout.staleness import StalenessCap


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("staleness")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="largest allowed lag (policy versions) of a resumed token behind the current policy")
    g.add_argument("--staleness-policy", choices=["restart", "mask", "keep"], default="restart",
                   help="what happens to a resumed sample over --max-staleness")
    g.add_argument("--disable-length-guard", action="store_true", default=False,
                   help="with --staleness-policy restart: restart a sample over --max-staleness every time (the guard, "
                        "on by default, masks its stale tokens instead, so long responses train as often as in a "
                        "synchronous run; docs/metrics.md)")
    if entry == "train_async.py":
        g.add_argument("--max-async-lag", type=int, default=1,
                       help="how many policy versions the rollout may run ahead of the trainer: a batch trained at "
                            "version P is collected while the engines serve versions >= P - lag (backpressure beyond)")


def check(a: Args, entry: str) -> None:
    try:  # the cap checks its own values (--max-staleness, --staleness-policy)
        StalenessCap.from_args(a)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _require(not a.disable_length_guard or (a.max_staleness is not None and a.staleness_policy == "restart"),
             "--disable-length-guard", "the guard acts only on --max-staleness with --staleness-policy restart")
    if entry == "train_async.py":
        _require(a.max_async_lag >= 1, "--max-async-lag", "must be >= 1 (0 is synchronous training: use train.py)")
        _require(a.max_async_lag >= a.update_weights_interval, "--max-async-lag",
                 f"({a.max_async_lag}) must be >= --update-weights-interval ({a.update_weights_interval}): between "
                 "two updates the engines fall that many versions behind, and a batch can only be collected within "
                 "the lag")
