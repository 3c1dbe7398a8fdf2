"""The rollout: the model the engines serve, the batch, lengths and sampling, how many steps, the rollout and
generate functions, and the timeouts of its requests."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import Args, _here, _require, flag_name, make_absolute

# the built-in APRIL rollout (--rollout-function-path's default); stream mode always runs it
BUILTIN_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("rollout")
    g.add_argument("--hf-checkpoint", type=str, default=None, help="local Hugging Face model directory (required)")
    g.add_argument("--rollout-batch-size", type=int, default=None, help="prompt groups per rollout step (required)")
    g.add_argument("--n-samples-per-prompt", type=int, default=1, help="samples per prompt group")
    g.add_argument("--rollout-max-prompt-len", type=int, default=None, help="prompts longer than this (tokens) are dropped")
    g.add_argument("--rollout-max-response-len", type=int, default=1024, help="response budget in tokens")
    g.add_argument("--rollout-max-context-len", type=int, default=None,
                   help="upstream slime's: prompt + response tokens a sample may reach (each request's max_new_tokens "
                        "is cut to what is left, a custom generate gets that as its budget; sets "
                        "--rollout-max-prompt-len to this - 1 when that is not given)")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--rollout-stop", type=str, nargs="*", default=None, help="stop strings")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="*", default=None, help="stop token ids")
    g.add_argument("--rollout-skip-special-tokens", action="store_true",
                   help="the engines leave special tokens out of the response text")
    g.add_argument("--rollout-shuffle", action="store_true", help="shuffle prompts each epoch (seeded)")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument("--num-rollout", type=int, default=None, help="number of rollout steps")
    g.add_argument("--num-epoch", type=int, default=None, help="epochs over the prompt data (sets --num-rollout)")
    g.add_argument("--rollout-function-path", type=str, default=BUILTIN_ROLLOUT_FUNCTION)
    g.add_argument("--custom-generate-function-path", type=str, default=None)
    g.add_argument("--rollout-ignore-eos", action="store_true", help="generate to the full budget (benchmarks)")
    g.add_argument("--rollout-request-timeout", type=float, default=1800.0, help="seconds for one /generate request")
    g.add_argument("--rollout-abort-timeout", type=float, default=120.0,
                   help="seconds for the engines to go idle and requests to drain after an abort")
    g.add_argument("--rollout-rpc-timeout", type=float, default=120.0, help="seconds for buffer / data-source calls")


def fill_defaults(a: Args) -> None:
    make_absolute(a, "hf_checkpoint")
    if a.rollout_max_context_len is not None and a.rollout_max_prompt_len is None:
        a.rollout_max_prompt_len = a.rollout_max_context_len - 1  # room for one response token (as upstream)


def check(a: Args, entry: str) -> None:
    _require(a.hf_checkpoint is not None, "--hf-checkpoint", "is required (a local Hugging Face model directory)")
    _require(_here(a, os.path.isdir(a.hf_checkpoint)), "--hf-checkpoint", f"{a.hf_checkpoint!r} is not a directory")
    _require(a.rollout_batch_size is not None and a.rollout_batch_size > 0, "--rollout-batch-size", "is required and must be > 0")
    _require(a.n_samples_per_prompt > 0, "--n-samples-per-prompt", "must be > 0")
    _require(a.rollout_max_response_len > 0, "--rollout-max-response-len", "must be > 0")
    _require(a.rollout_max_prompt_len is None or a.rollout_max_prompt_len > 0, "--rollout-max-prompt-len", "must be > 0")
    _require(a.rollout_max_context_len is None or a.rollout_max_context_len > 1, "--rollout-max-context-len",
             "must be > 1 (a prompt token and a response token)")
    _require(a.rollout_max_context_len is None or a.rollout_max_prompt_len < a.rollout_max_context_len,
             "--rollout-max-prompt-len", f"({a.rollout_max_prompt_len}) must be below --rollout-max-context-len "
             f"({a.rollout_max_context_len}): a prompt needs room for at least one response token")
    _require(a.rollout_temperature >= 0, "--rollout-temperature", "must be >= 0")
    _require(0 < a.rollout_top_p <= 1, "--rollout-top-p", "must be in (0, 1]")
    _require(a.rollout_top_k == -1 or a.rollout_top_k > 0, "--rollout-top-k", "must be -1 (off) or > 0")
    _require(a.num_rollout is not None or a.num_epoch is not None, "--num-rollout", "one of --num-rollout or --num-epoch is required")
    _require(a.num_rollout is None or a.num_rollout > 0, "--num-rollout", "must be > 0")
    _require(a.num_epoch is None or a.num_epoch > 0, "--num-epoch", "must be > 0")
    for name in ("rollout_request_timeout", "rollout_abort_timeout", "rollout_rpc_timeout"):
        _require(getattr(a, name) > 0, flag_name(name), "must be > 0")
