"""The trainer: its backend, batches and micro-batches, the optimizer and the learning-rate schedule."""

from __future__ import annotations

import argparse
import math

import slime.arguments.megatron as megatron
from slime.arguments.base import Args, _require, on_gpus


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--train-backend", choices=["auto", "fsdp", "megatron"], default="auto",
                   help="trainer: Megatron-core or FSDP2 (auto: megatron when megatron-core and CUDA are present, else fsdp)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: rollout batch size x n samples); samples a plugin "
                        "gave one rollout_id count once, as upstream")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout step: sets --global-batch-size to rollout-batch-size x "
                        "n-samples-per-prompt / this")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="micro-batches by token budget (--max-tokens-per-gpu), balanced across data-parallel ranks")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="token budget of a micro-batch with --use-dynamic-batch-size (a longer sample trains alone)")
    g.add_argument("--balance-data", action="store_true",
                   help="fixed-size micro-batches: each sample of an optimizer step goes to the data-parallel rank "
                        "with the fewest tokens (longest first) instead of striding (token-budget micro-batches, "
                        "--use-dynamic-batch-size, always balance)")
    g.add_argument("--micro-batch-layout", choices=["packed", "padded"], default="packed",
                   help="packed: a micro-batch's samples back to back without padding (attention stays inside each "
                        "sample); padded: right-padded to its longest sample")
    g.add_argument("--log-probs-chunk-size", type=int, default=0,
                   help="tokens per chunk of the log-prob / entropy head (logits are never held for more tokens); "
                        "0: auto (a chunk of ~16M logits on CPU, ~268M on a GPU), -1: the whole micro-batch at once")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.98)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--attn-implementation", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa",
                   help="attention kernel of the FSDP trainer's transformers model")
    g.add_argument("--optimizer", choices=["adam"], default="adam", help="Adam(W) with decoupled weight decay")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="learning-rate schedule over optimizer steps (non-constant: --train-backend megatron)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up from --lr-warmup-init")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="optimizer steps to decay over (linear / cosine)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")


def fill_defaults(a: Args) -> None:
    """auto: Megatron where it can run (megatron-core + GPUs), else FSDP; the optimizer batch; the decay."""
    if a.train_backend == "auto":
        a.train_backend = "megatron" if megatron.megatron_importable() and on_gpus(a) else "fsdp"
    if a.num_steps_per_rollout is not None and a.global_batch_size is None and a.rollout_batch_size is not None:
        a.global_batch_size = a.rollout_batch_size * a.n_samples_per_prompt // max(1, a.num_steps_per_rollout)
    if a.global_batch_size is None and a.rollout_batch_size is not None:
        a.global_batch_size = a.rollout_batch_size * a.n_samples_per_prompt
    if a.lr_decay_iters is None and a.lr_decay_style != "constant" and a.num_rollout and a.global_batch_size:
        steps_per_rollout = max(1, a.rollout_batch_size * a.n_samples_per_prompt // a.global_batch_size)
        a.lr_decay_iters = a.num_rollout * steps_per_rollout


def check(a: Args, entry: str) -> None:
    _require(a.num_steps_per_rollout is None or a.num_steps_per_rollout > 0, "--num-steps-per-rollout", "must be > 0")
    _require(a.num_steps_per_rollout is None or a.rollout_batch_size is None
             or a.global_batch_size * a.num_steps_per_rollout == a.rollout_batch_size * a.n_samples_per_prompt,
             "--num-steps-per-rollout", f"({a.num_steps_per_rollout}) must divide --rollout-batch-size x "
             f"--n-samples-per-prompt and agree with --global-batch-size ({a.global_batch_size})")
    samples = a.rollout_batch_size * a.n_samples_per_prompt
    _require(a.global_batch_size > 0, "--global-batch-size", "must be > 0")
    _require(samples % a.global_batch_size == 0, "--global-batch-size",
             f"({a.global_batch_size}) must divide --rollout-batch-size x --n-samples-per-prompt ({samples})")
    _require(a.micro_batch_size > 0, "--micro-batch-size", "must be > 0")
    _require(not a.use_dynamic_batch_size or (a.max_tokens_per_gpu or 0) > 0, "--max-tokens-per-gpu",
             "must be set (> 0) with --use-dynamic-batch-size")
    _require(a.log_probs_chunk_size >= -1, "--log-probs-chunk-size", "must be > 0, 0 (auto) or -1 (no chunking)")
    _require(math.isfinite(a.lr) and a.lr > 0, "--lr", "must be a finite number > 0")
    _require(a.adam_eps > 0, "--adam-eps", "must be > 0")
    _require(0 <= a.adam_beta1 < 1 and 0 <= a.adam_beta2 < 1, "--adam-beta1", "Adam betas must be in [0, 1)")
    _require(a.lr_warmup_iters >= 0, "--lr-warmup-iters", "must be >= 0")
    _require(0 <= a.min_lr <= a.lr, "--min-lr", "must be in [0, --lr]")
    _require(a.lr_decay_style == "constant" or (a.lr_decay_iters or 0) > 0, "--lr-decay-iters",
             f"must be > 0 with --lr-decay-style {a.lr_decay_style} (or give --num-rollout)")
