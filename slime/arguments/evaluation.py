"""Evaluation: the held-out prompts, how often, and its sampling (by default the rollout's)."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import Args, _here, _require, absolute


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("eval")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N rollout steps")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, help="name path [name path ...]")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    g.add_argument("--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    g.add_argument("--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len")
    g.add_argument("--eval-max-context-len", type=int, default=None, help="default: --rollout-max-context-len")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="the rollout function for evaluation (default: --rollout-function-path)")
    g.add_argument("--skip-eval-before-train", action="store_true", help="no eval of the starting point")


def fill_defaults(a: Args) -> None:
    for name in ("top_k", "temperature", "top_p", "max_response_len", "max_context_len"):  # default: the rollout's
        if getattr(a, f"eval_{name}") is None:
            setattr(a, f"eval_{name}", getattr(a, f"rollout_{name}"))
    if a.eval_prompt_data:  # name path [name path ...]
        a.eval_prompt_data = [absolute(v) if i % 2 else v for i, v in enumerate(a.eval_prompt_data)]
    pairs = a.eval_prompt_data or []
    a.eval_datasets = [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)]


def check(a: Args, entry: str) -> None:
    _require(a.eval_max_context_len is None or a.eval_max_context_len > 1, "--eval-max-context-len",
             "must be > 1 (a prompt token and a response token)")
    _require(a.eval_top_k == -1 or a.eval_top_k > 0, "--eval-top-k", "must be -1 (off) or > 0")
    _require(a.eval_prompt_data is None or len(a.eval_prompt_data) % 2 == 0, "--eval-prompt-data",
             "takes name/path pairs")
    for name, path in a.eval_datasets:
        _require(_here(a, os.path.isfile(path)), "--eval-prompt-data", f"{name}: {path!r} is not a file")
    _require(a.eval_interval is None or (a.eval_interval > 0 and a.eval_datasets), "--eval-interval",
             "must be > 0 and needs --eval-prompt-data")
    _require(a.n_samples_per_eval_prompt > 0, "--n-samples-per-eval-prompt", "must be > 0")
