"""The flags of the algorithm, the trainer (Megatron's included), logging, upstream's own and the dry run
(argparse groups; defaults written here)."""

from __future__ import annotations

import argparse


def _add_algorithm_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("algorithm")
    g.add_argument("--advantage-estimator", choices=["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"],
                   default="grpo")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None, help="default: --eps-clip")
    g.add_argument("--eps-clip-c", type=float, default=None, help="dual-clip bound (> 1) for negative advantages")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty folded into the reward (REINFORCE++)")
    g.add_argument("--gamma", type=float, default=1.0, help="discount for REINFORCE++ token returns")
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["k1", "k2", "k3", "low_var_kl"], default="k1")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--disable-grpo-std-normalization", action="store_true")
    g.add_argument("--normalize-advantages", action="store_true")
    g.add_argument("--calculate-per-token-loss", action="store_true", help="token-mean loss (default: per-sample mean)")
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss",
                   help="custom_loss (upstream's) is refused: its function gets Megatron's sharded logits and "
                        "upstream's batch dict, which this trainer does not build")
    g.add_argument("--use-tis", action="store_true", help="truncated importance sampling against behaviour log-probs")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)


def _add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per optimizer step (default: rollout batch size x n samples); samples a plugin "
                        "gave one rollout_id count once, as upstream")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--use-dynamic-batch-size", action="store_true",
                   help="micro-batches by token budget (--max-tokens-per-gpu), balanced across data-parallel ranks")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="token budget of a micro-batch with --use-dynamic-batch-size (a longer sample trains alone)")
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
    g.add_argument("--load", type=str, default=None, help="checkpoint directory to resume from")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="with --load: resume from this rollout id's checkpoint (iter_N) instead of the newest")
    g.add_argument("--save", type=str, default=None, help="checkpoint directory (every --save-interval steps and after the last)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--ref-load", type=str, default=None,
                   help="reference model (default: --hf-checkpoint); with --train-backend megatron a torch_dist "
                        "checkpoint (tools/convert_hf_to_torch_dist.py) or a HF directory, which is also the "
                        "actor's starting point when --load has no checkpoint (as in slime)")
    g.add_argument("--attn-implementation", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa",
                   help="attention kernel of the FSDP trainer's transformers model")
    g.add_argument("--optimizer", choices=["adam"], default="adam", help="Adam(W) with decoupled weight decay")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="learning-rate schedule over optimizer steps (non-constant: --train-backend megatron)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="optimizer steps of linear warm-up from --lr-warmup-init")
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="optimizer steps to decay over (linear / cosine)")
    g.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of the decay")
    g.add_argument("--update-weight-buffer-size", type=int, default=512 * 1024**2, help="bytes per weight-sync bucket")
    g.add_argument("--update-weight-mode", type=_update_weight_mode, default=None,
                   help="how weights reach the engines: tensor (CUDA IPC handles / shared memory to the engine on the "
                        "same devices; needs --colocate), distributed (a broadcast group) or disk (a saved directory); "
                        "default: tensor with --colocate, else distributed")
    g.add_argument("--update-weights-from-disk", action="store_true",
                   help="slime's flag: the same as --update-weight-mode disk")
    g.add_argument("--update-weights-interval", type=int, default=1,
                   help="push the trainer's weights to the engines every N steps: train_async.py (in flight); "
                        "train.py takes only 1 (it pushes after every step)")


UPDATE_WEIGHT_MODES = ("tensor", "distributed", "disk")


def _update_weight_mode(value: str) -> str:
    if value in UPDATE_WEIGHT_MODES:
        return value
    if value in ("full", "delta"):  # upstream slime's values (with --update-weight-transport nccl | disk)
        raise argparse.ArgumentTypeError(
            f"{value!r} is upstream slime's; here the mode is the transport: tensor (colocated), distributed (upstream's "
            "full with --update-weight-transport nccl) or disk (full with disk); delta is not supported")
    raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(UPDATE_WEIGHT_MODES)}")


def _add_megatron_args(p: argparse.ArgumentParser) -> None:
    """Megatron-LM's flags under their own names (what slime's scripts pass)."""
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


def _add_logging_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--use-wandb", action=argparse.BooleanOptionalAction, default=True,
                   help="also log to wandb, offline unless --wandb-mode online (--no-use-wandb: metrics.jsonl only)")
    g.add_argument("--wandb-project", type=str, default="slime-april")
    g.add_argument("--wandb-group", type=str, default=None)
    g.add_argument("--wandb-mode", choices=["offline", "online", "disabled"], default=None,
                   help="default: online with --wandb-key, else offline")
    g.add_argument("--wandb-key", type=str, default=None,
                   help="upstream slime's: the W&B API key this run logs in with (online by default then); prefer "
                        "WANDB_API_KEY in the environment: a flag's value shows in the process list")
    g.add_argument("--run-dir", type=str, default=None,
                   help="metrics.jsonl, traces, logs (default: runs/<date-time> under the working directory)")


def _add_upstream_args(p: argparse.ArgumentParser) -> None:
    """Upstream slime's flags that exist here only for its scripts (the rest are refused with what to use instead:
    slime/upstream_flags.py; docs/upstream-flags.md)."""
    g = p.add_argument_group("upstream slime compatibility")
    g.add_argument("--rollout-global-dataset", action="store_true",
                   help="upstream's; the only mode here: every rollout draws its prompts from --prompt-data")
    g.add_argument("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                   help="upstream's name for --offload (the trainer's state off the GPU while the engines generate)")
    g.add_argument("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                   help="upstream's: engines release weights and KV cache while the trainer trains, which --colocate "
                        "always does (needs --colocate)")
    g.add_argument("--balance-data", action="store_true",
                   help="fixed-size micro-batches: each sample of an optimizer step goes to the data-parallel rank "
                        "with the fewest tokens (longest first) instead of striding (token-budget micro-batches, "
                        "--use-dynamic-batch-size, always balance)")
    g.add_argument("--eval-function-path", type=str, default=None,
                   help="the rollout function for evaluation (default: --rollout-function-path)")
    g.add_argument("--skip-eval-before-train", action="store_true", help="no eval of the starting point")
    g.add_argument("--num-steps-per-rollout", type=int, default=None,
                   help="optimizer steps per rollout step: sets --global-batch-size to rollout-batch-size x "
                        "n-samples-per-prompt / this")
    g.add_argument("--rollout-skip-special-tokens", action="store_true",
                   help="the engines leave special tokens out of the response text")
    g.add_argument("--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    g.add_argument("--get-mismatch-metrics", action="store_true",
                   help="upstream's; always on here: train/ reports the engine vs trainer log-prob mismatch every step")
    for name in ("gradient-accumulation", "masked-softmax"):
        g.add_argument(f"--no-{name}-fusion", action="store_true",
                       help="Megatron's; always the case here (apex's fused kernels are not used)")
    g.add_argument("--no-rope-fusion", action="store_true",
                   help="Megatron's: no fused RoPE (Transformer Engine's, or ours compiled with --compile-ops)")


def _add_debug_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("debug")
    g.add_argument("--debug-rollout-only", action="store_true")
    g.add_argument("--debug-train-only", action="store_true")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="path template with {rollout_id}")
    g.add_argument("--load-debug-rollout-data", type=str, default=None, help="path template with {rollout_id}")


# the cards a dry run can size its memory estimate for (slime/rollout/simulator/gpu_presets.py's datasheets)
DRY_RUN_GPUS = ("h100", "h200", "mi300x")


def _add_dry_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dry run (docs/gpu.md: the first thing to run before spending GPUs)")
    g.add_argument("--dry-run", nargs="?", const="h100", choices=DRY_RUN_GPUS, default=None,
                   help="check the whole command line as it would run on GPUs of this kind (h100 when not named) and "
                        "exit: flags, the model's config, the --sglang-* / --router-* pass-through flags, the plugins' "
                        "imports and signatures; print the effective settings, the placement and an estimate of "
                        "memory per GPU. Starts no Ray, engine or trainer; paths not on this machine are listed")
