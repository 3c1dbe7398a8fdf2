"""Megatron-LM's flags under their own names (what slime's scripts pass): parallelism, precision, recompute and the
model's shape, with upstream's effective defaults; the conversion tools' parser (`megatron_flags`)."""

from __future__ import annotations

import argparse
import os
from typing import Callable, Sequence

from slime.arguments.base import ArgumentError, Args, _require, flag_name, on_gpus


def add(p: argparse.ArgumentParser, entry: str | None = None) -> None:
    g = p.add_argument_group("megatron: parallelism, precision, recompute")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="only 1 is supported")
    g.add_argument("--context-parallel-size", type=int, default=1, help="only 1 is supported")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="only 1 (dense models)")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="only 1 (dense models)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard activations along the sequence over TP ranks")
    g.add_argument("--use-distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                   help="shard the optimizer state over data-parallel ranks (default: on with --train-backend megatron, "
                        "as upstream; --no-use-distributed-optimizer: every rank holds all of it)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron's DDP: a bucket's gradient reduction starts in the backward of the optimizer step's "
                        "last micro-batch, as soon as the bucket's gradients are ready")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="distributed optimizer: the all-gather of the updated weights after an optimizer step waits "
                        "for the next step's forward (overlapping it); train() gathers them in full before it returns, "
                        "so a weight push, save or export never reads another rank's stale shard. Needs "
                        "--use-distributed-optimizer and --overlap-grad-reduce (Megatron-LM's rules)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 compute with fp32 master weights and optimizer (Megatron: bf16 weights + fp32 main "
                        "copies; FSDP: bf16 mixed-precision policy over fp32 sharded weights); default: on where the "
                        "trainer runs on a GPU (upstream always trains bf16), fp32 on CPU; --no-bf16: fp32")
    g.add_argument("--fp16", action="store_true", help="not supported (use --bf16)")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
                   help="auto / flash: torch SDPA (flash kernels on GPU); unfused / local: megatron's own attention; "
                        "fused needs TransformerEngine (not supported)")
    g.add_argument("--compile-ops", nargs="?", const="on", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the element-wise work of each layer (RMSNorm, SwiGLU) and of the log-prob head "
                        "into fused kernels, both trainer backends; auto: on where the trainer runs on a GPU (0.80x "
                        "the time per train() on an H200, benchmarks/train_throughput.py), off on CPU (inductor's "
                        "C++ compile costs more than it saves there); the bare flag means on")
    g.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"], default="auto",
                   help="the layer GPTModel is built from: Transformer Engine's fused layer spec, or megatron's local "
                        "spec with torch kernels (auto: TE where transformer_engine imports on a CUDA machine)")
    g.add_argument("--attention-dropout", type=float, default=None, help="default: the HF config's")
    g.add_argument("--hidden-dropout", type=float, default=None, help="default: 0")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron: gradients accumulated and all-reduced in fp32 (default: on under --bf16, as "
                        "Megatron-LM turns it on for bf16)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of lcm(this, TP) (padded rows never get probability; "
                        "one padded size for every TP that divides it, so checkpoints reshard across TP)")
    if entry is not None:  # upstream's scripts pass these to train.py
        for name in ("gradient-accumulation", "masked-softmax"):
            g.add_argument(f"--no-{name}-fusion", action="store_true",
                           help="Megatron's; always the case here (apex's fused kernels are not used)")
        g.add_argument("--no-rope-fusion", action="store_true",
                       help="Megatron's: no fused RoPE (Transformer Engine's, or ours compiled with --compile-ops)")

    m = p.add_argument_group("megatron: model shape (optional; when given, must match --hf-checkpoint's config.json)")
    for name, typ in (("num-layers", int), ("hidden-size", int), ("ffn-hidden-size", int), ("num-attention-heads", int),
                      ("num-query-groups", int), ("kv-channels", int), ("vocab-size", int),
                      ("max-position-embeddings", int), ("norm-epsilon", float), ("rotary-base", float)):
        m.add_argument(f"--{name}", type=typ, default=None)
    for name in ("swiglu", "group-query-attention", "qk-layernorm", "add-qkv-bias", "disable-bias-linear",
                 "untie-embeddings-and-output-weights", "use-rotary-position-embeddings"):
        m.add_argument(f"--{name}", action="store_true", default=None)
    m.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None)
    m.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None)
    m.add_argument("--rotary-percent", type=float, default=1.0, help="only 1.0 is supported")
    m.add_argument("--use-rope-scaling", action="store_true", help="not supported (Llama 3.1+ rope scaling)")
    m.add_argument("--rotary-scaling-factor", type=float, default=None, help="not supported")


def megatron_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def megatron_flags(argv: Sequence[str] = (), description: str | None = None,
                   extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """Only the Megatron flags (MODEL_ARGS, TP, --bf16, ...), for the conversion tools; `extra` adds the
    tool's own arguments. Model-shape flags are checked against the HF config by the tool."""
    p = argparse.ArgumentParser(description=description, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add(p)
    if extra is not None:
        extra(p)
    ns = p.parse_args(list(argv))
    # a tool stores and builds what it is told: fp32 unless --bf16 (a trainer casts what it loads to its precision)
    for name in ("bf16", "use_distributed_optimizer", "accumulate_allreduce_grads_in_fp32"):
        if vars(ns)[name] is None:
            setattr(ns, name, False)
    return ns


def fill_defaults(a: Args) -> None:
    """Upstream's effective defaults (bf16 on GPUs, the distributed optimizer, fp32 gradient accumulation under
    bf16), each turned off by an explicit --no-<flag>."""
    megatron = a.train_backend == "megatron"
    if a.bf16 is None:
        a.bf16 = on_gpus(a)
    if a.use_distributed_optimizer is None:
        a.use_distributed_optimizer = megatron
    if a.accumulate_allreduce_grads_in_fp32 is None:
        a.accumulate_allreduce_grads_in_fp32 = megatron and a.bf16


# Megatron-only flags: (name, value that means "not used")
_MEGATRON_ONLY = (
    ("tensor_model_parallel_size", 1), ("sequence_parallel", False), ("use_distributed_optimizer", False),
    ("overlap_grad_reduce", False), ("overlap_param_gather", False),
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


def check(a: Args, entry: str) -> None:
    """Parallelism / precision / recompute, and the model-shape flags against --hf-checkpoint's config."""
    from slime.utils.model_shape import ModelShapeError, flag_mismatches, read_shape, shape_from_flags

    for name, unused, why in _UNSUPPORTED:
        _require(getattr(a, name) == unused, flag_name(name), why)
    _require(a.expert_tensor_parallel_size in (None, 1), "--expert-tensor-parallel-size", "MoE models are not supported yet")
    _require(a.rotary_percent == 1.0, "--rotary-percent", "only 1.0 (rope on every channel) is supported")
    _require(a.attention_backend != "fused", "--attention-backend fused",
             "needs TransformerEngine, which this backend does not use; use flash (torch SDPA) or unfused")
    if a.train_backend == "fsdp":
        for name, unused in _MEGATRON_ONLY:
            _require(getattr(a, name) == unused, flag_name(name), "is supported by --train-backend megatron only")
    else:
        _require(megatron_importable(), "--train-backend megatron",
                 "megatron-core is not installed (pip install megatron-core psutil)")
    tp = a.tensor_model_parallel_size
    world = a.actor_num_nodes * a.actor_num_gpus_per_node
    _require(tp >= 1 and world % tp == 0, "--tensor-model-parallel-size",
             f"({tp}) must divide the trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node = {world})")
    _require(not a.sequence_parallel or tp > 1, "--sequence-parallel", "needs --tensor-model-parallel-size > 1")
    if a.overlap_param_gather:
        _require(a.use_distributed_optimizer, "--overlap-param-gather", "needs --use-distributed-optimizer")
        _require(a.overlap_grad_reduce, "--overlap-param-gather", "needs --overlap-grad-reduce")
    if a.recompute_granularity == "full":
        _require(a.recompute_method is not None, "--recompute-method", "is required with --recompute-granularity full")
        _require((a.recompute_num_layers or 0) >= 1, "--recompute-num-layers",
                 "must be >= 1 with --recompute-granularity full")
    else:
        _require(a.recompute_method is None and a.recompute_num_layers is None, "--recompute-method",
                 "and --recompute-num-layers need --recompute-granularity full")
    _require(a.make_vocab_size_divisible_by >= 1, "--make-vocab-size-divisible-by", "must be >= 1")

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
