"""Every flag, with slime's names, parsed and validated in this package (the only place a default is written).

`parse_args(argv)` returns an immutable `Args`: after parsing, code reads
typed values and nobody mutates them. Other `--sglang-<flag>` options are
passed through to SGLang servers (`args.sglang_extra_args`) and upstream's
`--router-<flag>` ones to sglang-router (`args.router_extra_args`), each
checked against the real part's flags (slime/utils/sglang_flags.py).

The flags are defined by group in rollout_flags.py and train_flags.py, their rules by group in checks.py; the
pass-through options are read in pass_through.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Sequence

from slime.arguments.base import _AGENT_DEFAULTS, BUILTIN_MULTI_TURN_GENERATE, ArgumentError, Args, _require
from slime.arguments.checks import (check_cluster, check_data, check_eval, check_faults, check_model, check_placement,
                                    check_rollout, check_training, validate_agent_args, validate_async_args,
                                    validate_given_args, validate_loss_args, validate_weight_update_interval)
from slime.arguments.pass_through import _split_pass_through
from slime.arguments.rollout_flags import (ASYNC_PAUSE_MODE, _add_agent_args, _add_async_args, _add_cluster_args,
                                           _add_data_args, _add_eval_args, _add_fault_tolerance_args, _add_partial_rollout_args,
                                           _add_reward_args, _add_rollout_args, _add_sglang_args)
from slime.arguments.train_flags import (_add_algorithm_args, _add_debug_args, _add_dry_run_args, _add_logging_args,
                                         _add_megatron_args, _add_training_args, _add_upstream_args)


def megatron_flags(argv: Sequence[str] = (), description: str | None = None,
                   extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Only the Megatron flags (MODEL_ARGS, TP, --bf16, ...), for the conversion tools; `extra` adds the
    tool's own arguments. Model-shape flags are checked against the HF config by the tool."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_megatron_args(p)
    if extra is not None:
        extra(p)
    ns = p.parse_args(list(argv))
    # a tool stores and builds what it is told: fp32 unless --bf16 (a trainer casts what it loads to its precision)
    for name in ("bf16", "use_distributed_optimizer", "accumulate_allreduce_grads_in_fp32"):
        if vars(ns)[name] is None:
            setattr(ns, name, False)
    return ns


ENTRIES = {
    "train.py": "RL post-training with APRIL partial rollouts",
    "train_async.py": "asynchronous RL post-training: the rollout of the next steps overlaps training, with APRIL "
                      "partial rollouts and exact per-token policy versions",
}


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
    adders = [_add_cluster_args, _add_rollout_args, _add_fault_tolerance_args, _add_partial_rollout_args,
              _add_data_args, _add_eval_args, _add_algorithm_args, _add_training_args, _add_megatron_args,
              _add_reward_args, _add_agent_args, _add_logging_args, _add_debug_args, _add_sglang_args,
              _add_upstream_args, _add_dry_run_args]
    if entry == "train_async.py":
        adders.insert(4, _add_async_args)
    for add in adders:
        add(p)
    if entry == "train_async.py":
        p.set_defaults(pause_mode=ASYNC_PAUSE_MODE)
    return p


def megatron_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _on_gpus(a: Args) -> bool:
    """Whether the trainer runs on GPUs: CUDA (or ROCm) here, or a dry run of a GPU command line."""
    if a.dry_run is not None:
        return True
    import torch

    return torch.cuda.is_available()


def _resolve_train_backend(requested: str, gpus: bool) -> str:
    """auto: Megatron where it is meant to run (megatron-core + GPUs), else FSDP."""
    if requested != "auto":
        return requested
    return "megatron" if megatron_importable() and gpus else "fsdp"


def _fill_trainer_defaults(a: Args, gpus: bool) -> None:
    """Upstream's effective defaults: its Megatron argument post-processing forces bf16 and the distributed optimizer
    (and Megatron-LM fp32 gradient accumulation under bf16), and --colocate turns on the trainer's offload. Here each
    is a default that an explicit --no-<flag> turns off; bf16 only where the trainer runs on GPUs (CPU runs are
    tests and tiny tasks, fp32)."""
    megatron = a.train_backend == "megatron"
    if a.bf16 is None:
        a.bf16 = gpus
    if a.use_distributed_optimizer is None:
        a.use_distributed_optimizer = megatron
    if a.accumulate_allreduce_grads_in_fp32 is None:
        a.accumulate_allreduce_grads_in_fp32 = megatron and a.bf16
    if a.offload_train is not None:  # upstream's name for --offload
        _require(a.offload in (None, a.offload_train), "--offload-train",
                 "contradicts --offload / --no-offload (upstream's name for the same thing)")
        a.offload = a.offload_train
    if a.offload is None:
        a.offload = a.colocate


# Flags that name files or directories: made absolute at parse time, so every process of the run (Ray
# workers on any node, whatever their working directory) reads the same path.
PATH_FLAGS = ("hf_checkpoint", "prompt_data", "load", "save", "ref_load", "run_dir", "save_debug_rollout_data",
              "load_debug_rollout_data")


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _make_paths_absolute(a: Args) -> None:
    for name in PATH_FLAGS:
        if getattr(a, name) is not None:
            setattr(a, name, _absolute(getattr(a, name)))
    if a.eval_prompt_data:  # name path [name path ...]
        a.eval_prompt_data = [_absolute(v) if i % 2 else v for i, v in enumerate(a.eval_prompt_data)]
    if a.rollout_cost_model is not None and not a.rollout_cost_model.startswith("gpu:"):
        a.rollout_cost_model = _absolute(a.rollout_cost_model)


def _fill_defaults(a: Args) -> None:
    gpus = _on_gpus(a)
    a.train_backend = _resolve_train_backend(a.train_backend, gpus)
    _fill_trainer_defaults(a, gpus)
    if a.run_dir is None:
        a.run_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    _make_paths_absolute(a)
    if a.rollout_num_gpus is None:
        a.rollout_num_gpus = a.actor_num_nodes * a.actor_num_gpus_per_node if a.colocate else 1
    if a.over_sampling_batch_size is None:
        a.over_sampling_batch_size = a.rollout_batch_size
    if a.num_steps_per_rollout is not None and a.global_batch_size is None and a.rollout_batch_size is not None:
        a.global_batch_size = a.rollout_batch_size * a.n_samples_per_prompt // max(1, a.num_steps_per_rollout)
    if a.global_batch_size is None and a.rollout_batch_size is not None:
        a.global_batch_size = a.rollout_batch_size * a.n_samples_per_prompt
    if a.wandb_mode is None:
        a.wandb_mode = "online" if a.wandb_key else "offline"
    if a.eval_top_k is None:
        a.eval_top_k = a.rollout_top_k
    if a.eps_clip_high is None:
        a.eps_clip_high = a.eps_clip
    if a.eval_temperature is None:
        a.eval_temperature = a.rollout_temperature
    if a.eval_top_p is None:
        a.eval_top_p = a.rollout_top_p
    if a.eval_max_response_len is None:
        a.eval_max_response_len = a.rollout_max_response_len
    if a.rollout_max_context_len is not None and a.rollout_max_prompt_len is None:
        a.rollout_max_prompt_len = a.rollout_max_context_len - 1  # room for one response token (as upstream)
    if a.eval_max_context_len is None:
        a.eval_max_context_len = a.rollout_max_context_len
    a.num_engines = max(1, a.rollout_num_gpus // max(1, a.rollout_num_gpus_per_engine))
    if a.admission is None:  # a pool size given by hand is kept; otherwise the engines' loads decide
        a.admission = "auto" if a.rollout_mode in ("pool", "stream") and a.rollout_pool_size is None else "fixed"
    if (a.rollout_pool_size is None and a.rollout_mode == "stream" and a.admission == "fixed"
            and a.rollout_batch_size is not None):
        # one batch's requests: the stream refills as groups finish, so more only adds stale, parked work
        a.rollout_pool_size = min(a.rollout_batch_size * a.n_samples_per_prompt, a.sglang_server_concurrency * a.num_engines)
    if a.update_weight_mode is None:
        a.update_weight_mode = "disk" if a.update_weights_from_disk else ("tensor" if a.colocate else "distributed")
    if a.rollout_pool_size is None:
        a.rollout_pool_size = a.sglang_server_concurrency * a.num_engines
    if a.lr_decay_iters is None and a.lr_decay_style != "constant" and a.num_rollout and a.global_batch_size:
        steps_per_rollout = max(1, a.rollout_batch_size * a.n_samples_per_prompt // a.global_batch_size)
        a.lr_decay_iters = a.num_rollout * steps_per_rollout
    pairs = a.eval_prompt_data or []
    a.eval_datasets = [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs) - 1, 2)]
    _fill_agent_defaults(a)


def _fill_agent_defaults(a: Args) -> None:
    if a.agent_env is None:
        return
    for name, value in _AGENT_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.custom_generate_function_path is None:
        a.custom_generate_function_path = BUILTIN_MULTI_TURN_GENERATE


def validate_args(a: Args, entry: str = "train.py") -> None:
    """All rules, by flag group (slime/arguments/checks.py); each error names the flag and the rule."""
    check_placement(a)
    check_model(a)
    validate_trainer_args(a)
    check_rollout(a, entry)
    check_cluster(a)
    check_data(a)
    check_faults(a)
    check_training(a)
    check_eval(a)
    validate_agent_args(a)
    validate_loss_args(a)
    validate_weight_update_interval(a, entry)
    if entry == "train_async.py":
        validate_async_args(a)


# Megatron-only flags: (name, value that means "not used")
_MEGATRON_ONLY = (
    ("tensor_model_parallel_size", 1), ("sequence_parallel", False), ("use_distributed_optimizer", False),
    ("recompute_granularity", None), ("attention_backend", "auto"),
    ("accumulate_allreduce_grads_in_fp32", False), ("attention_softmax_in_fp32", False), ("hidden_dropout", None),
    ("transformer_impl", "auto"),
    ("attention_dropout", None), ("lr_decay_style", "constant"), ("lr_warmup_iters", 0),
)


# Features no backend has: (name, value that means "not used", why)
_UNSUPPORTED = (
    ("pipeline_model_parallel_size", 1, "pipeline parallelism is not supported yet; use tensor/data parallelism"),
    ("context_parallel_size", 1, "context parallelism is not supported yet"),
    ("expert_model_parallel_size", 1, "MoE models are not supported yet"),
    ("fp16", False, "fp16 training is not supported; use --bf16"),
    ("use_rope_scaling", False, "rope scaling (Llama 3.1+) is not supported yet"),
    ("rotary_scaling_factor", None, "rope scaling (Llama 3.1+) is not supported yet"),
)


def validate_trainer_args(a: Args) -> None:
    """The trainer backend's flags: Megatron's parallelism / precision / recompute and model-shape flags."""
    from slime.utils.model_shape import ModelShapeError, flag_mismatches, read_shape, shape_from_flags

    flag_of = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    for name, unused, why in _UNSUPPORTED:
        _require(getattr(a, name) == unused, flag_of(name), why)
    _require(a.expert_tensor_parallel_size in (None, 1), "--expert-tensor-parallel-size", "MoE models are not supported yet")
    _require(a.rotary_percent == 1.0, "--rotary-percent", "only 1.0 (rope on every channel) is supported")
    _require(a.attention_backend != "fused", "--attention-backend fused",
             "needs TransformerEngine, which this backend does not use; use flash (torch SDPA) or unfused")
    if a.train_backend == "fsdp":
        for name, unused in _MEGATRON_ONLY:
            _require(getattr(a, name) == unused, flag_of(name), "is supported by --train-backend megatron only")
    else:
        _require(megatron_importable(), "--train-backend megatron",
                 "megatron-core is not installed (pip install megatron-core psutil)")
    tp = a.tensor_model_parallel_size
    world = a.actor_num_nodes * a.actor_num_gpus_per_node
    _require(tp >= 1 and world % tp == 0, "--tensor-model-parallel-size",
             f"({tp}) must divide the trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node = {world})")
    _require(not a.sequence_parallel or tp > 1, "--sequence-parallel", "needs --tensor-model-parallel-size > 1")
    if a.recompute_granularity == "full":
        _require(a.recompute_method is not None, "--recompute-method", "is required with --recompute-granularity full")
        _require((a.recompute_num_layers or 0) >= 1, "--recompute-num-layers",
                 "must be >= 1 with --recompute-granularity full")
    else:
        _require(a.recompute_method is None and a.recompute_num_layers is None, "--recompute-method",
                 "and --recompute-num-layers need --recompute-granularity full")
    _require(a.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by", "must be >= 1")
    _require(a.lr_warmup_iters >= 0, "--lr-warmup-iters", "must be >= 0")
    _require(0 <= a.min_lr <= a.lr, "--min-lr", "must be in [0, --lr]")
    _require(a.lr_decay_style == "constant" or (a.lr_decay_iters or 0) > 0, "--lr-decay-iters",
             f"must be > 0 with --lr-decay-style {a.lr_decay_style} (or give --num-rollout)")

    config = os.path.join(a.hf_checkpoint, "config.json")
    if a.dry_run is not None and not os.path.isfile(config):
        # a dry run without the model here: the shape MODEL_ARGS describe, if they do (the dry run says so)
        try:
            shape = shape_from_flags(a)
        except ModelShapeError:
            return
    else:
        try:
            shape = read_shape(a.hf_checkpoint)
        except ModelShapeError as e:
            if a.train_backend == "megatron":
                raise ArgumentError(f"--hf-checkpoint: {e}") from e
            return  # FSDP trains any HF causal LM; model-shape flags cannot be checked against this one
        errors = flag_mismatches(a, shape, config)
        _require(not errors, "model-shape flags", "; ".join(errors))
    if a.train_backend == "megatron":
        _require(shape.num_attention_heads % tp == 0 and shape.num_query_groups % tp == 0,
                 "--tensor-model-parallel-size", f"({tp}) must divide the attention heads "
                 f"({shape.num_attention_heads}) and key/value heads ({shape.num_query_groups})")
        _require(shape.ffn_hidden_size % tp == 0, "--tensor-model-parallel-size",
                 f"({tp}) must divide the MLP width ({shape.ffn_hidden_size})")


def _given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str, ...]:
    """The flags the command line gave, each under all its names (`--router-policy` and `--sglang-router-policy`,
    `--use-wandb` and `--no-use-wandb`), without values (they may hold keys): the dry run lists what it left out."""
    named = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    for action in parser._actions:
        if named.intersection(action.option_strings):
            named.update(action.option_strings)
    return tuple(sorted(named))


def parse_args(argv: Sequence[str] | None = None, entry: str = "train.py") -> Args:
    """Parse `entry`'s flags (train.py or train_async.py), fill derived defaults, validate, freeze;
    raises `ArgumentError` naming the flag and rule."""
    parser = build_parser(entry)
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, unknown = parser.parse_known_args(argv, namespace=Args())
    ns.sglang_extra_args, ns.router_extra_args = _split_pass_through(unknown, parser, ns.rollout_backend)
    ns.given_flags = _given_flags(parser, argv)
    validate_given_args(ns)
    _fill_defaults(ns)
    validate_args(ns, entry)
    return ns._freeze()
