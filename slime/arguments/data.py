"""The prompts a run learns from and their reward."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import Args, _here, _require, make_absolute


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", type=str, default=None, help="jsonl or parquet file of prompts")
    g.add_argument("--input-key", type=str, default="prompt")
    g.add_argument("--label-key", type=str, default=None)
    g.add_argument("--metadata-key", type=str, default="metadata")
    g.add_argument("--apply-chat-template", action="store_true")
    g.add_argument("--rollout-global-dataset", action="store_true",
                   help="upstream's; the only mode here: every rollout draws its prompts from --prompt-data")

    r = p.add_argument_group("reward")
    r.add_argument("--rm-type", type=str, default=None,
                   help="deepscaler | dapo | math | boxed_<type> | remote_rm | subtract_chain")
    r.add_argument("--custom-rm-path", type=str, default=None)
    r.add_argument("--rm-url", type=str, default=None)
    r.add_argument("--group-rm", action="store_true")
    r.add_argument("--reward-timeout", type=float, default=60.0, help="seconds before a reward counts as failed")
    r.add_argument("--reward-key", type=str, default=None, help="key of a dict reward used by filters and advantages")


def fill_defaults(a: Args) -> None:
    make_absolute(a, "prompt_data")


def check(a: Args, entry: str) -> None:
    if a.load_debug_rollout_data is None:  # a replay of saved steps needs neither prompts nor a reward
        _require(a.prompt_data is not None, "--prompt-data", "is required (or --load-debug-rollout-data)")
        _require(_here(a, os.path.isfile(a.prompt_data)), "--prompt-data", f"{a.prompt_data!r} is not a file")
        _require(a.rm_type is not None or a.custom_rm_path is not None, "--rm-type",
                 "one of --rm-type or --custom-rm-path is required")
    _require(a.rm_type != "remote_rm" or a.rm_url is not None, "--rm-url", "is required with --rm-type remote_rm")
    _require(a.reward_timeout > 0, "--reward-timeout", "must be > 0")
