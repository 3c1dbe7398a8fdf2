"""What a run puts on each GPU, from its flags alone: the effective trainer settings, which GPU holds which trainer
rank and engine, and an estimate of memory per GPU (`train.py --dry-run`; the model is in docs/gpu.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from slime.utils.model_shape import ModelShape, num_params

GB = 1e9
# per process: the CUDA context and what the caching allocator keeps after an offload / a release (docs/gpu.md)
PROCESS_OVERHEAD = 0.8 * GB
# SGLang's use beyond its static fraction (CUDA graphs, sampling and activation buffers): an assumption
ENGINE_OVERHEAD = 3.0 * GB
# SGLang picks --mem-fraction-static from the card when it is not given; the estimate then assumes this
SGLANG_DEFAULT_MEM_FRACTION = 0.85
# logits per chunk of the log-prob head on a GPU (slime/backends/training_utils/logprob_head.py's auto size)
HEAD_CHUNK_LOGITS = 2**28
# activation bytes per token per layer: 2 x (4h + 3q + 2kv + 3f) in bf16 with fused element-wise kernels
# (--compile-ops auto); eager kernels (--compile-ops off) keep about this many times more (docs/gpu.md)
EAGER_ACTIVATION_FACTOR = 1.8


def data_parallel_size(args) -> int:
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    return world // args.tensor_model_parallel_size if args.train_backend == "megatron" else world


def effective_settings(args) -> str:
    """One line: the trainer's precision, how its optimizer state is sharded, and whether it is offloaded."""
    dp = data_parallel_size(args)
    if args.bf16:
        precision = ("bf16 weights and compute, fp32 main weights and Adam state, gradients reduced in "
                     + ("fp32" if args.accumulate_allreduce_grads_in_fp32 else "bf16")
                     if args.train_backend == "megatron" else "bf16 compute over fp32 sharded weights and Adam state")
    else:
        precision = "fp32 weights, compute and Adam state"
    if args.train_backend == "fsdp":
        sharding = f"optimizer state sharded over {dp} rank(s) (FSDP2)"
    elif args.use_distributed_optimizer:
        sharding = f"optimizer state sharded over {dp} data-parallel rank(s) (distributed optimizer)"
    else:
        sharding = "optimizer state whole on every rank (--no-use-distributed-optimizer)"
    if args.offload:
        offload = "trainer offloaded to host memory while the engines generate"
    elif args.colocate:
        offload = "trainer stays on the devices while the engines generate (--no-offload)"
    else:
        offload = "trainer on its own devices (not colocated)"
    return f"trainer {args.train_backend}: {precision}; {sharding}; {offload}"


# --- placement ---------------------------------------------------------------------------------------------------
def placement(args) -> list[str]:
    """Which GPU runs which trainer rank and engine, in the order the placement group's bundles are laid out (nodes
    of --actor-num-gpus-per-node GPUs; non-colocated engines take the bundles after the trainers')."""
    per_node, tp, k = args.actor_num_gpus_per_node, args.tensor_model_parallel_size, args.rollout_num_gpus_per_engine
    if args.train_backend != "megatron":
        tp = 1
    world = args.actor_num_nodes * per_node
    first_engine_gpu = 0 if args.colocate else world
    lines = []
    for gpu in range(world + (0 if args.colocate else args.rollout_num_gpus)):
        where = f"node {gpu // per_node} GPU {gpu % per_node}" if gpu < world else f"rollout GPU {gpu - world}"
        held = []
        if gpu < world:
            held.append(f"trainer rank {gpu} (TP {gpu % tp}, DP {gpu // tp})")
        e = gpu - first_engine_gpu
        if 0 <= e < args.rollout_num_gpus:
            held.append(f"engine {e // k}" + (f" (TP {e % k} of {k})" if k > 1 else ""))
        lines.append(f"{where}: " + " + ".join(held))
    return lines


# --- memory ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    weights: float
    grads: float
    optimizer: float
    activations: float
    head: float
    engine: float  # SGLang while generating (static fraction + overhead)
    engine_weights: float  # an engine's share of the weights (back on the GPU for the hand-over)
    tokens: int  # the largest micro-batch
    mem_fraction: float
    mem_fraction_given: bool
    phases: dict  # phase -> bytes on the fullest GPU

    @property
    def peak(self) -> float:
        return max(self.phases.values())


def micro_batch_tokens(args) -> int:
    """Tokens of the largest micro-batch: --max-tokens-per-gpu, or one whole prompt + response budget."""
    sample = (args.rollout_max_prompt_len or 0) + args.rollout_max_response_len
    if args.use_dynamic_batch_size:
        return max(args.max_tokens_per_gpu, sample)
    return args.micro_batch_size * sample


def _activation_bytes(args, shape: ModelShape, tokens: int, tp: int) -> float:
    h, f = shape.hidden_size, shape.ffn_hidden_size
    q, kv = shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    element = 2 if args.bf16 else 4
    sp = args.sequence_parallel
    # per token: the residual-stream tensors (layer inputs, norms) split over TP only with sequence parallelism
    stream, sharded = 4 * h / (tp if sp else 1), (3 * q + 2 * kv + 3 * f) / tp
    per_layer = element * tokens * (stream + sharded)
    if args.compile_ops == "off":
        per_layer *= EAGER_ACTIVATION_FACTOR
    if args.recompute_granularity == "full":
        kept = element * tokens * h / (tp if sp else 1) * shape.num_layers / (args.recompute_num_layers or 1)
        return kept + per_layer * (args.recompute_num_layers or 1)
    return per_layer * shape.num_layers


def estimate_memory(args, shape: ModelShape, card_bytes: float) -> MemoryEstimate:
    megatron = args.train_backend == "megatron"
    tp = args.tensor_model_parallel_size if megatron else 1
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    dp = data_parallel_size(args)
    vocab = -(-shape.vocab_size // math.lcm(args.make_vocab_size_divisible_by, tp)) * math.lcm(
        args.make_vocab_size_divisible_by, tp) if megatron else shape.vocab_size
    params = num_params(shape, vocab)
    if megatron:
        local = params / tp
        weights = local * (2 if args.bf16 else 4)
        grads = local * (4 if args.accumulate_allreduce_grads_in_fp32 or not args.bf16 else 2)
        optimizer = local * (12 if args.bf16 else 8) / (dp if args.use_distributed_optimizer else 1)
    else:  # FSDP2: fp32 master weights, gradients and Adam state sharded over every rank, one layer gathered at a time
        layer = (params - vocab * shape.hidden_size) / shape.num_layers
        weights = params * 4 / world + 2 * layer * (2 if args.bf16 else 4)
        grads, optimizer = params * 4 / world, params * 8 / world
    tokens = micro_batch_tokens(args)
    activations = _activation_bytes(args, shape, tokens, tp)
    logits = tokens * vocab / tp
    chunk = logits if args.log_probs_chunk_size == -1 else min(logits, HEAD_CHUNK_LOGITS if args.log_probs_chunk_size == 0
                                                               else args.log_probs_chunk_size * vocab / tp)
    head = 2 * 4 * chunk  # a chunk's fp32 logits, forward and backward
    given = args.sglang_extra_args.get("mem-fraction-static")
    try:
        fraction = float(given) if given is not None else SGLANG_DEFAULT_MEM_FRACTION
    except (TypeError, ValueError):
        raise ValueError(f"--sglang-mem-fraction-static: {given!r} is not a number") from None
    engine = fraction * card_bytes + ENGINE_OVERHEAD
    engine_weights = params * 2 / args.rollout_num_gpus_per_engine
    states = weights + grads + optimizer
    training = PROCESS_OVERHEAD + states + activations + head
    if args.colocate:
        phases = {
            "rollout": engine + PROCESS_OVERHEAD + (0.0 if args.offload else states),
            "training": PROCESS_OVERHEAD + training,
            "weight hand-over": PROCESS_OVERHEAD + engine_weights + training - activations - head
                                + args.update_weight_buffer_size,
        }
    else:
        phases = {"training (trainer GPUs)": training, "rollout (engine GPUs)": engine + PROCESS_OVERHEAD}
    return MemoryEstimate(weights, grads, optimizer, activations, head, engine, engine_weights, tokens, fraction,
                          given is not None, phases)


def memory_report(args, shape: ModelShape, card_name: str, card_bytes: float) -> tuple[list[str], bool]:
    """(lines, whether the fullest GPU fits the card)."""
    m = estimate_memory(args, shape, card_bytes)
    gb = lambda b: f"{b / GB:.1f} GB"  # noqa: E731
    recompute = f"{args.recompute_granularity} recompute" if args.recompute_granularity else "no recompute"
    fraction = (f"--sglang-mem-fraction-static {m.mem_fraction:g}" if m.mem_fraction_given else
                f"SGLang's own choice, assumed {m.mem_fraction:g}")
    lines = [
        f"memory per GPU (estimate for {card_name}, {gb(card_bytes)}; docs/gpu.md says how it is counted):",
        f"  trainer rank: weights {gb(m.weights)}, gradients {gb(m.grads)}, optimizer {gb(m.optimizer)}, "
        f"activations {gb(m.activations)} ({m.tokens} tokens, {recompute}), log-prob head {gb(m.head)}",
        f"  engine: {gb(m.engine)} while generating ({fraction} of the card + {gb(ENGINE_OVERHEAD)}), "
        f"released while the trainer trains" if args.colocate else
        f"  engine: {gb(m.engine)} ({fraction} of the card + {gb(ENGINE_OVERHEAD)})",
    ]
    lines += [f"  {phase}: {gb(b)}" for phase, b in m.phases.items()]
    fits = m.peak <= card_bytes
    lines.append(f"  peak {gb(m.peak)} of {gb(card_bytes)}: " + ("fits" if fits else "DOES NOT FIT"))
    return lines, fits
