"""Every flag, with slime's names, parsed and validated here (the only place a default is written): one module per
flag group with its flags (`add`), derived defaults (`fill_defaults`) and rules (`check`, each naming the flag)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from slime.arguments import (algorithm, cluster, data, debug, engines, evaluation, faults, megatron, multi_turn,
                             partial_rollout, rollout, run, staleness, trainer, weight_updates)
from slime.arguments.base import ArgumentError, Args
from slime.arguments.megatron import megatron_flags
from slime.arguments.multi_turn import BUILTIN_MULTI_TURN_GENERATE
from slime.arguments.pass_through import _split_pass_through
from slime.arguments.weight_updates import ASYNC_PAUSE_MODE

__all__ = ["ASYNC_PAUSE_MODE", "BUILTIN_MULTI_TURN_GENERATE", "ArgumentError", "Args", "build_parser",
           "megatron_flags", "parse_args"]

ENTRIES = {
    "train.py": "RL post-training with APRIL partial rollouts",
    "train_async.py": "asynchronous RL post-training: the rollout of the next steps overlaps training, with APRIL "
                      "partial rollouts and exact per-token policy versions",
}

# in --help order
GROUPS = (cluster, engines, rollout, partial_rollout, staleness, weight_updates, faults, data, evaluation, algorithm,
          trainer, megatron, run, multi_turn, debug)
# defaults that read other groups' values come after them
FILL_ORDER = (trainer, megatron, cluster, rollout, partial_rollout, weight_updates, data, evaluation, algorithm, run,
              multi_turn, debug)
# a group's rules may rely on an earlier group's (e.g. the rollout batch before the trainer's batch divides it)
CHECK_ORDER = (weight_updates, cluster, rollout, trainer, megatron, engines, partial_rollout, staleness, data, debug,
               faults, run, algorithm, evaluation, multi_turn)


def build_parser(entry: str = "train.py") -> argparse.ArgumentParser:
    """The parser of one entry point; the asynchronous flags exist only for train_async.py."""
    if entry not in ENTRIES:
        raise ValueError(f"build_parser: unknown entry point {entry!r} (one of {sorted(ENTRIES)})")
    p = argparse.ArgumentParser(
        prog=entry,
        description=ENTRIES[entry],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    for group in GROUPS:
        group.add(p, entry)
    return p


def _given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str, ...]:
    """The flags the command line gave, each under all its names (`--router-policy` and `--sglang-router-policy`,
    `--use-wandb` and `--no-use-wandb`), without values (they may hold keys): the dry run lists what it left out."""
    named = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    for action in parser._actions:
        if named.intersection(action.option_strings):
            named.update(action.option_strings)
    return tuple(sorted(named))


def parse_args(argv: Sequence[str] | None = None, entry: str = "train.py") -> Args:
    """Parse `entry`'s flags, fill derived defaults, validate, freeze; `ArgumentError` names flag and rule."""
    parser = build_parser(entry)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, unknown = parser.parse_known_args(argv, namespace=Args())
    ns.sglang_extra_args, ns.router_extra_args = _split_pass_through(unknown, parser, ns.rollout_backend)
    ns.given_flags = _given_flags(parser, argv)
    partial_rollout.check_given(ns)  # what the user wrote, before the defaults fill the gaps
    for group in FILL_ORDER:
        group.fill_defaults(ns)
    for group in CHECK_ORDER:
        group.check(ns, entry)
    return ns._freeze()
