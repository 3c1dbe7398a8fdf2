"""Every flag, with slime's names, parsed and validated in one place.

`parse_args(argv)` returns an immutable `Args`: after parsing, code reads
typed values and nobody mutates them. Other `--sglang-<flag>` options are
passed through to SGLang servers (`args.sglang_extra_args`) and upstream's
`--router-<flag>` ones to sglang-router (`args.router_extra_args`), each
checked against the real part's flags (slime/utils/sglang_flags.py).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
import time
from typing import Any, Callable, Sequence

from slime.upstream_flags import refusal
from slime.utils.net import AUTO, WILDCARDS, interface_addresses, is_ip_address, is_loopback


class ArgumentError(ValueError):
    """A flag value breaks a rule; the message names the flag and the rule."""


class Args(argparse.Namespace):
    """The parsed flags, read-only once `parse_args` returns."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise AttributeError(f"args are read-only after parsing (tried to set {name!r})")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"args are read-only after parsing (tried to delete {name!r})")

    def for_plugins(self):
        """The one writable copy of these flags that every plugin in this process gets (slime/utils/plugin_args.py);
        what plugins write to it never changes these."""
        view = self.__dict__.get("_plugin_view")
        if view is None:
            from slime.utils.plugin_args import PluginArgs

            view = self.__dict__["_plugin_view"] = PluginArgs(self)
        return view

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_plugin_view"}  # each process makes its own

    def _freeze(self) -> "Args":
        super().__setattr__("_frozen", True)
        return self

    def replace(self, **changes: Any) -> "Args":
        """A new frozen copy with some values changed (for tests and tools); only existing flags can change.

        Derived values (`num_engines`, `eval_datasets`, defaults filled from other flags) are not
        recomputed: change them too when the flags they come from change.
        """
        values = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        unknown = sorted(set(changes) - set(values))
        if unknown:
            raise AttributeError(f"Args.replace: no flag named {unknown[0]!r} (misspelt?)")
        values.update(changes)
        return Args(**values)._freeze()


# the built-in APRIL rollout (--rollout-function-path's default); stream mode always runs it
BUILTIN_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"

def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="number of nodes for training actors")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=1,
                   help="training actors per node (one per GPU; on a CPU machine, one process each)")
    g.add_argument("--rollout-num-gpus", type=int, default=None,
                   help="devices for rollout engines (on CPU: engine slots); default 1, or all actor devices with --colocate")
    g.add_argument("--rollout-num-gpus-per-engine", type=int, default=1, help="tensor-parallel size of each engine")
    g.add_argument("--colocate", action="store_true",
                   help="trainers and engines time-share the same devices: one bundle per device holds a trainer rank "
                        "and (a share of) an engine; the engines release their memory while the trainer trains")
    g.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="with --colocate: the trainer's parameters, gradients and optimizer state leave the device "
                        "between training phases (host memory) and come back for the next one (default: on with "
                        "--colocate, as upstream; --no-offload keeps the trainer on the device)")
    g.add_argument("--train-backend", choices=["auto", "fsdp", "megatron"], default="auto",
                   help="trainer: Megatron-core or FSDP2 (auto: megatron when megatron-core and CUDA are present, else fsdp)")
    g.add_argument("--rollout-backend", choices=["auto", "embedded", "sglang"], default="auto",
                   help="engines: real SGLang servers, or the embedded CPU engine (auto: sglang when CUDA and sglang are present)")
    g.add_argument("--embedded-engine-threads", type=int, default=1, help="torch threads of each embedded engine")
    g.add_argument("--sglang-python", type=str, default=os.environ.get("SLIME_SGLANG_PYTHON") or None,
                   help="the interpreter that runs `sglang.launch_server` (--rollout-backend sglang; default "
                        "$SLIME_SGLANG_PYTHON, else this one): on a CPU box, the venv `python tools/sglang_cpu_env.py "
                        "install` builds (scripts/quickstart.sh does it for --rollout-backend sglang)")
    g.add_argument("--train-num-threads", type=int, default=1, help="torch threads of each trainer process (CPU)")
    g.add_argument("--listen-host", type=str, default="auto",
                   help="where the run's servers listen (trainer stores and gloo, the weight-update store, the "
                        "engines, the local Ray node; none authenticates), resolved on each node: auto = 127.0.0.1 "
                        "while the Ray cluster is one machine, else each node's own IP as Ray knows it; an interface "
                        "name (eth0) = that interface's address on every node (also GLOO/NCCL_SOCKET_IFNAME); an "
                        "address (127.0.0.1, 0.0.0.0, 10.0.0.5) = as given")


def _add_rollout_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--engine-startup-timeout", type=float, default=None,
                   help="seconds to wait for an engine to be healthy (default 180 embedded, 900 SGLang)")


def _add_fault_tolerance_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance (an engine watchdog always runs; restarts need --use-fault-tolerance)")
    g.add_argument("--use-fault-tolerance", action="store_true",
                   help="restart an engine that dies or freezes during a rollout (re-sync the current weights, resume "
                        "its parked samples), the router (same port, engines registered again) and a trainer that "
                        "dies or runs out of memory (from the last checkpoint, the engines kept, the steps since "
                        "replayed); without it such a failure stops the run with an error naming the part")
    g.add_argument("--rollout-health-check-interval", type=float, default=10.0,
                   help="seconds between GET /health_generate checks of every engine while a step runs "
                        "(0: HTTP checks off; dead or stopped engine processes are still noticed within 1 s)")
    g.add_argument("--rollout-health-check-timeout", type=float, default=30.0,
                   help="seconds an engine may take to answer /health_generate before it counts as frozen")
    g.add_argument("--rollout-health-check-first-wait", type=float, default=0.0,
                   help="seconds before the first HTTP health check of a step (slow first compilations)")
    g.add_argument("--max-engine-restarts", type=int, default=3,
                   help="restarts allowed in a run (--use-fault-tolerance), of engines, the router and the trainer "
                        "together; one more failure checkpoints (with --save, where it can) and stops the run")
    g.add_argument("--max-consecutive-empty-steps", type=int, default=3,
                   help="stop the run when this many steps in a row have no trainable sample (every group failed); "
                        "such steps are skipped (no update, no version bump) and counted")


def _add_partial_rollout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("partial rollout (APRIL)")
    g.add_argument("--partial-rollout", action="store_true",
                   help="abort unfinished requests once the batch is full and park them in the buffer to resume next step")
    g.add_argument("--over-sampling-batch-size", type=_int_or_auto, default=None,
                   help="groups submitted per chunk: > rollout batch size over-samples; smaller submits chunks until "
                        "the target is met; equal (default) is synchronous; 'auto': each step's size is chosen by the "
                        "rollout simulator from what the last steps showed (response lengths incl. the unfinished "
                        "tail, the dynamic filter's pass rate, --max-staleness), logged as rollout/over_sampling_batch_size")
    g.add_argument("--rollout-cost-model", type=str, default=None,
                   help="engine cost model for --over-sampling-batch-size auto: a JSON from `tools/simulate_rollout.py "
                        "calibrate`, or gpu:<h100|h200|mi300x>:<model>:tp<N> (modelled from datasheets); default: "
                        "calibrate the engines after the first step (a few seconds)")
    g.add_argument("--buffer-filter-path", type=str, default=None, help="order in which parked groups are resumed (default FIFO)")
    g.add_argument("--dynamic-sampling-filter-path", type=str, default=None,
                   help="e.g. slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std")
    g.add_argument("--rollout-mode", choices=["chunked", "pool", "stream"], default="chunked",
                   help="chunked: submit whole chunks of groups; pool: keep --rollout-pool-size requests in flight (CoPRIS); "
                        "stream (train_async.py only): keep --rollout-pool-size requests in flight across steps, the "
                        "trainer takes the next --rollout-batch-size accepted groups as soon as they exist")
    g.add_argument("--rollout-pool-size", type=int, default=None,
                   help="requests in flight in pool and stream modes (default: --sglang-server-concurrency x engines; "
                        "stream: --rollout-batch-size x --n-samples-per-prompt, at most that)")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="largest allowed lag (policy versions) of a resumed token behind the current policy")
    g.add_argument("--staleness-policy", choices=["restart", "mask", "keep"], default="restart",
                   help="what happens to a resumed sample over --max-staleness")
    g.add_argument("--reuse-stale-kv", action="store_true",
                   help="weight updates keep the engines' cache (flush_cache=false), so a parked sample resumes on "
                        "the KV its earlier tokens had (computed by older weights) instead of being re-prefilled; "
                        "its tokens keep their versions and go through the same off-policy correction")


def _int_or_auto(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {value!r}") from None


def _add_data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", type=str, default=None, help="jsonl or parquet file of prompts")
    g.add_argument("--input-key", type=str, default="prompt")
    g.add_argument("--label-key", type=str, default=None)
    g.add_argument("--metadata-key", type=str, default="metadata")
    g.add_argument("--apply-chat-template", action="store_true")


def _add_eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("eval")
    g.add_argument("--eval-interval", type=int, default=None, help="evaluate every N rollout steps")
    g.add_argument("--eval-prompt-data", type=str, nargs="+", default=None, help="name path [name path ...]")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    g.add_argument("--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len")
    g.add_argument("--eval-max-context-len", type=int, default=None, help="default: --rollout-max-context-len")


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


def _add_reward_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reward")
    g.add_argument("--rm-type", type=str, default=None,
                   help="deepscaler | dapo | math | boxed_<type> | remote_rm | subtract_chain")
    g.add_argument("--custom-rm-path", type=str, default=None)
    g.add_argument("--rm-url", type=str, default=None)
    g.add_argument("--group-rm", action="store_true")
    g.add_argument("--reward-timeout", type=float, default=60.0, help="seconds before a reward counts as failed")
    g.add_argument("--reward-key", type=str, default=None, help="key of a dict reward used by filters and advantages")


# the built-in multi-turn generate that --agent-env runs
BUILTIN_MULTI_TURN_GENERATE = "slime.rollout.multi_turn.generate"
# multi-turn flags that mean nothing without --agent-env, and their defaults with it
_AGENT_DEFAULTS = {"max_turns": 16, "tool_timeout": 30.0, "tool_workers": 4, "tool_max_output_chars": 4096,
                   "tool_memory_mb": 2048}


def _add_agent_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn tool use (docs/multi-turn.md)")
    g.add_argument("--agent-env", type=str, default=None,
                   help="dotted path of an AgentEnv (slime/utils/tool_calls.py: tools, call format): samples become "
                        "multi-turn trajectories of model turns and tool calls, generated by "
                        f"{BUILTIN_MULTI_TURN_GENERATE} (set as --custom-generate-function-path); they survive "
                        "APRIL's abort and resume at any point, a finished tool call is never run twice")
    g.add_argument("--max-turns", type=int, default=None,
                   help=f"model turns per trajectory (default {_AGENT_DEFAULTS['max_turns']}); a call in the last "
                        "one is not run and the sample is truncated")
    g.add_argument("--max-tokens-per-turn", type=int, default=None,
                   help="tokens per model turn (default: only --rollout-max-response-len, which counts the whole "
                        "response, observations included)")
    g.add_argument("--tool-timeout", type=float, default=None,
                   help=f"seconds a tool call may run (default {_AGENT_DEFAULTS['tool_timeout']:g}; a tool's own "
                        "ToolSpec.timeout_s wins); past it the call's worker is killed and the sample fails")
    g.add_argument("--tool-workers", type=int, default=None,
                   help=f"tool worker processes (default {_AGENT_DEFAULTS['tool_workers']}): calls run in parallel "
                        "up to this many")
    g.add_argument("--tool-max-output-chars", type=int, default=None,
                   help=f"a tool's output is cut to this many characters (default "
                        f"{_AGENT_DEFAULTS['tool_max_output_chars']})")
    g.add_argument("--tool-memory-mb", type=int, default=None,
                   help=f"address-space cap of each tool worker (default {_AGENT_DEFAULTS['tool_memory_mb']}; 0: none)")


def _fill_agent_defaults(a: Args) -> None:
    if a.agent_env is None:
        return
    for name, value in _AGENT_DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.custom_generate_function_path is None:
        a.custom_generate_function_path = BUILTIN_MULTI_TURN_GENERATE


def validate_agent_args(a: Args) -> None:
    if a.agent_env is None:
        for name in (*_AGENT_DEFAULTS, "max_tokens_per_turn"):
            _require(getattr(a, name) is None, "--" + name.replace("_", "-"), "needs --agent-env (multi-turn tool use)")
        return
    _require(a.agent_env.count(".") >= 1 and " " not in a.agent_env, "--agent-env",
             f"{a.agent_env!r} is not a dotted path (package.module.ENV)")
    _require(a.custom_generate_function_path == BUILTIN_MULTI_TURN_GENERATE, "--agent-env",
             f"runs the built-in multi-turn generate ({BUILTIN_MULTI_TURN_GENERATE}); --custom-generate-function-path "
             f"{a.custom_generate_function_path} would never use it")
    _require(a.max_turns >= 1, "--max-turns", "must be >= 1")
    _require(a.max_tokens_per_turn is None or a.max_tokens_per_turn >= 1, "--max-tokens-per-turn", "must be >= 1")
    _require(a.tool_timeout > 0, "--tool-timeout", "must be > 0")
    _require(a.tool_workers >= 1, "--tool-workers", "must be >= 1")
    _require(a.tool_max_output_chars >= 1, "--tool-max-output-chars", "must be >= 1")
    _require(a.tool_memory_mb >= 0, "--tool-memory-mb", "must be >= 0 (0: no cap)")


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


def _add_async_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("asynchronous training (train_async.py)")
    g.add_argument("--max-async-lag", type=int, default=1,
                   help="how many policy versions the rollout may run ahead of the trainer: a batch trained at "
                        "version P is collected while the engines serve versions >= P - lag (backpressure beyond)")
    g.add_argument("--in-flight-update", choices=["auto", "abort", "in_place"], default="auto",
                   help="how a weight update reaches requests in flight. abort: every request is aborted, waits, and "
                        "resumes from its tokens under the new version (SGLang's documented pause path; any engine). "
                        "in_place: requests run on and the engine labels each token with the version that sampled it "
                        "(meta_info.weight_versions; the embedded engine). auto: in_place on the embedded engine, "
                        "abort on SGLang")


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


def _add_sglang_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sglang (any other --sglang-<flag> of SGLang's ServerArgs is passed to the servers, "
                             "and upstream's --router-<flag> to sglang-router as --<flag>; both checked at parse time)")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="use this router instead of starting one")
    g.add_argument("--sglang-router-port", type=int, default=None)
    g.add_argument("--sglang-router-policy", "--router-policy", type=str, default="round_robin",
                   help="sglang-router's --policy (upstream's default: cache_aware)")
    g.add_argument("--sglang-router-log-level", "--router-log-level", type=str, default="warn")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=None)
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="requests in flight per engine")


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
    return p


def _option_chunks(unknown: list[str]) -> list[list[str]]:
    """The options argparse did not know, each with the values that follow it."""
    chunks: list[list[str]] = []
    for tok in unknown:
        if tok.startswith("--") or not chunks:
            chunks.append([tok])
        else:
            chunks[-1].append(tok)
    return chunks


def _split_pass_through(unknown: list[str], parser: argparse.ArgumentParser, rollout_backend: str
                        ) -> tuple[dict, tuple[str, ...]]:
    """The `--sglang-<flag>[=][value ...]` options for SGLang's servers ({name: value, a list of values, or True})
    and upstream's `--router-<flag>` ones for sglang-router (its launcher's argv), each checked against the real
    part's own flags; anything else is refused, naming the flag."""
    from slime.utils.sglang_flags import router_pass_through, unknown_flag_error

    ours = [o for a in parser._actions for o in a.option_strings]
    server = None
    if rollout_backend == "embedded":  # the embedded engine takes those of SGLang's flags it has, and its own
        from slime.backends.hf_engine.__main__ import build_parser as engine_parser

        server = (frozenset(o[2:] for a in engine_parser()._actions for o in a.option_strings if o.startswith("--")),
                  "the embedded engine (--rollout-backend embedded)")
    sglang: dict[str, Any] = {}
    router: list[str] = []
    for tok, *values in _option_chunks(unknown):
        flag, eq, value = tok.partition("=")
        instead = refusal(flag)
        if instead is not None:
            raise ArgumentError(f"{flag}: upstream slime's flag is not taken here: {instead}")
        if flag.startswith("--router-"):
            router += [tok, *values]
        elif flag.startswith("--sglang-") and len(flag) > len("--sglang-"):
            name = flag[len("--sglang-"):]
            error = unknown_flag_error(name, [o for o in ours if o.startswith("--sglang-")], server)
            if error is not None:
                raise ArgumentError(error)
            given = [value] if eq else values
            sglang[name] = True if not given else given[0] if len(given) == 1 else given
        else:
            close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.8)
            raise ArgumentError(f"unrecognized argument: {tok}" + (f" (did you mean {close[0]}?)" if close else ""))
    try:
        return sglang, router_pass_through(router, [o for o in ours if o.startswith("--router-")])
    except ValueError as e:
        raise ArgumentError(str(e)) from None


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
    if a.rollout_pool_size is None and a.rollout_mode == "stream" and a.rollout_batch_size is not None:
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


def _require(cond: bool, flag: str, rule: str) -> None:
    if not cond:
        raise ArgumentError(f"{flag}: {rule}")


def _here(a: Args, exists: bool) -> bool:
    """A path check; a dry run passes it (the path may live only on the GPU machines: the dry run lists what is
    not on this one)."""
    return exists or a.dry_run is not None


def validate_async_args(a: Args) -> None:
    """train_async.py's rules (its flags exist only in its parser)."""
    _require(a.max_async_lag >= 1, "--max-async-lag", "must be >= 1 (0 is synchronous training: use train.py)")
    _require(a.max_async_lag >= a.update_weights_interval, "--max-async-lag",
             f"({a.max_async_lag}) must be >= --update-weights-interval ({a.update_weights_interval}): between two "
             "updates the engines fall that many versions behind, and a batch can only be collected within the lag")
    _require(not (a.in_flight_update == "in_place" and a.rollout_backend == "sglang"), "--in-flight-update in_place",
             "SGLang holds a weight update until the requests in flight finish (its model-update lock); use abort")
    _require(not a.colocate, "--colocate", "train_async.py overlaps rollout and training, so engines and trainers "
             "need their own devices; use train.py for colocated runs")
    _require(not a.use_fault_tolerance, "--use-fault-tolerance", "train_async.py does not restart engines under a "
             "running rollout yet (an engine fault stops the run, naming the engine); use train.py to restart them")
    for value, flag in ((a.debug_rollout_only, "--debug-rollout-only"), (a.debug_train_only, "--debug-train-only"),
                        (a.load_debug_rollout_data, "--load-debug-rollout-data")):
        _require(not value, flag, "has no rollout and training to overlap; use train.py")
    _require(a.rollout_mode != "stream" or a.rollout_function_path == BUILTIN_ROLLOUT_FUNCTION, "--rollout-function-path",
             f"--rollout-mode stream runs the built-in rollout ({BUILTIN_ROLLOUT_FUNCTION}), not {a.rollout_function_path}")


def validate_given_args(a: Args) -> None:
    """Rules about what the user wrote, checked before defaults fill the gaps."""
    _require(a.over_sampling_batch_size is None or a.rollout_mode == "chunked", "--over-sampling-batch-size",
             f"sizes --rollout-mode chunked's over-sampled chunks; --rollout-mode {a.rollout_mode} keeps "
             "--rollout-pool-size requests in flight instead (drop --over-sampling-batch-size, or set --rollout-pool-size)")


def validate_args(a: Args, entry: str = "train.py") -> None:
    """All rules in one place; each error names the flag and the rule."""
    _require(not a.offload or a.colocate, "--offload", "needs --colocate (the engines use the memory it frees)")
    _require(not a.offload_rollout or a.colocate, "--offload-rollout",
             "needs --colocate (engines release their memory for a trainer on the same devices)")
    _require(a.offload_rollout is not False or not a.colocate, "--no-offload-rollout",
             "contradicts --colocate: colocated engines release weights and KV cache while the trainer trains")
    _require(a.num_steps_per_rollout is None or a.num_steps_per_rollout > 0, "--num-steps-per-rollout", "must be > 0")
    _require(a.num_steps_per_rollout is None or a.rollout_batch_size is None
             or a.global_batch_size * a.num_steps_per_rollout == a.rollout_batch_size * a.n_samples_per_prompt,
             "--num-steps-per-rollout", f"({a.num_steps_per_rollout}) must divide --rollout-batch-size x "
             f"--n-samples-per-prompt and agree with --global-batch-size ({a.global_batch_size})")
    _require(a.eval_top_k == -1 or a.eval_top_k > 0, "--eval-top-k", "must be -1 (off) or > 0")
    _require(not a.update_weights_from_disk or a.update_weight_mode == "disk", "--update-weights-from-disk",
             f"contradicts --update-weight-mode {a.update_weight_mode}")
    _require(not (a.colocate and a.reuse_stale_kv), "--reuse-stale-kv",
             "contradicts --colocate: colocated engines release their KV cache while the trainer trains")
    _require(not a.colocate or a.actor_num_nodes == 1, "--colocate",
             "on more than one node is not built yet: engines are placed on every node's trainer bundles, but the "
             "weight handover by tensor (CUDA IPC / shared memory) and the device plan that feeds it are per node")
    _require(a.update_weight_mode != "tensor" or a.colocate, "--update-weight-mode tensor",
             "needs --colocate (tensors are handed over on the devices trainer and engines share)")
    _require(a.hf_checkpoint is not None, "--hf-checkpoint", "is required (a local Hugging Face model directory)")
    _require(_here(a, os.path.isdir(a.hf_checkpoint)), "--hf-checkpoint", f"{a.hf_checkpoint!r} is not a directory")
    validate_trainer_args(a)
    _require(a.rollout_batch_size is not None and a.rollout_batch_size > 0, "--rollout-batch-size", "is required and must be > 0")
    _require(a.n_samples_per_prompt > 0, "--n-samples-per-prompt", "must be > 0")
    _require(a.rollout_max_response_len > 0, "--rollout-max-response-len", "must be > 0")
    _require(a.rollout_max_prompt_len is None or a.rollout_max_prompt_len > 0, "--rollout-max-prompt-len", "must be > 0")
    for flag in ("rollout_max_context_len", "eval_max_context_len"):
        _require(getattr(a, flag) is None or getattr(a, flag) > 1, "--" + flag.replace("_", "-"),
                 "must be > 1 (a prompt token and a response token)")
    _require(a.rollout_max_context_len is None or a.rollout_max_prompt_len < a.rollout_max_context_len,
             "--rollout-max-prompt-len", f"({a.rollout_max_prompt_len}) must be below --rollout-max-context-len "
             f"({a.rollout_max_context_len}): a prompt needs room for at least one response token")
    _require(a.rollout_temperature >= 0, "--rollout-temperature", "must be >= 0")
    _require(0 < a.rollout_top_p <= 1, "--rollout-top-p", "must be in (0, 1]")
    _require(a.rollout_top_k == -1 or a.rollout_top_k > 0, "--rollout-top-k", "must be -1 (off) or > 0")
    if a.over_sampling_batch_size == "auto":
        _require(a.custom_generate_function_path is None, "--over-sampling-batch-size",
                 "auto plans with the rollout simulator, which models one request per sample; with "
                 "--custom-generate-function-path / --agent-env give a size")
    else:
        _require(a.over_sampling_batch_size > 0, "--over-sampling-batch-size", "must be > 0 (or auto)")
    if a.rollout_cost_model is not None:
        _require(a.over_sampling_batch_size == "auto", "--rollout-cost-model", "is used by --over-sampling-batch-size auto only")
        _require(a.rollout_cost_model.startswith("gpu:") or _here(a, os.path.isfile(a.rollout_cost_model)),
                 "--rollout-cost-model",
                 f"{a.rollout_cost_model!r} is neither a file nor gpu:<gpu>:<model>:tp<N>")
    _require(a.rollout_num_gpus_per_engine > 0, "--rollout-num-gpus-per-engine", "must be > 0")
    _require(a.rollout_num_gpus % a.rollout_num_gpus_per_engine == 0, "--rollout-num-gpus",
             f"({a.rollout_num_gpus}) must be divisible by --rollout-num-gpus-per-engine ({a.rollout_num_gpus_per_engine})")
    _require(a.sglang_server_concurrency > 0, "--sglang-server-concurrency", "must be > 0")
    _require(a.rollout_pool_size > 0, "--rollout-pool-size", "must be > 0")
    _require(a.rollout_mode != "stream" or entry == "train_async.py", "--rollout-mode stream",
             "keeps requests in flight while the trainer trains, which needs train_async.py")
    _require(a.rollout_mode != "stream" or a.partial_rollout, "--rollout-mode stream",
             "needs --partial-rollout (requests in flight at a checkpoint or an update are parked and resumed)")
    _require(a.max_staleness is None or a.max_staleness >= 0, "--max-staleness", "must be >= 0")
    _require(a.embedded_engine_threads > 0, "--embedded-engine-threads", "must be > 0")
    _require(a.train_num_threads > 0, "--train-num-threads", "must be > 0")
    _require(a.actor_num_nodes > 0, "--actor-num-nodes", "must be > 0")
    _require(a.actor_num_gpus_per_node > 0, "--actor-num-gpus-per-node", "must be > 0")
    _require(a.rollout_num_gpus > 0, "--rollout-num-gpus", "must be > 0")
    _require(a.listen_host in (AUTO, "localhost") or a.listen_host in WILDCARDS[1:] or is_ip_address(a.listen_host)
             or a.listen_host in interface_addresses(), "--listen-host",
             f"{a.listen_host!r} is neither auto, an IP address nor an interface of this machine "
             f"({', '.join(sorted(interface_addresses()))})")
    actor_devices = a.actor_num_nodes * a.actor_num_gpus_per_node
    _require(not a.colocate or a.rollout_num_gpus == actor_devices, "--rollout-num-gpus",
             f"({a.rollout_num_gpus}) must equal the trainer devices ({actor_devices}) with --colocate: every device "
             f"holds a trainer rank and a share of an engine")
    _require(a.actor_num_nodes == 1 or not is_loopback(a.listen_host), "--listen-host",
             f"is {a.listen_host} (loopback) but --actor-num-nodes is {a.actor_num_nodes}: other nodes cannot reach it; "
             "leave it at auto (each node's own IP), or give an interface name or 0.0.0.0")

    _require(not (a.debug_rollout_only and a.debug_train_only), "--debug-rollout-only",
             "cannot be combined with --debug-train-only")
    if a.load_debug_rollout_data is None:
        _require(a.prompt_data is not None, "--prompt-data", "is required (or --load-debug-rollout-data)")
        _require(_here(a, os.path.isfile(a.prompt_data)), "--prompt-data", f"{a.prompt_data!r} is not a file")
        _require(a.rm_type is not None or a.custom_rm_path is not None, "--rm-type",
                 "one of --rm-type or --custom-rm-path is required")
    else:
        _require("{rollout_id}" in a.load_debug_rollout_data, "--load-debug-rollout-data",
                 "must contain {rollout_id} in its path template")
    if a.save_debug_rollout_data is not None:
        _require("{rollout_id}" in a.save_debug_rollout_data, "--save-debug-rollout-data",
                 "must contain {rollout_id} in its path template")
    _require(a.num_rollout is not None or a.num_epoch is not None, "--num-rollout", "one of --num-rollout or --num-epoch is required")
    _require(a.num_rollout is None or a.num_rollout > 0, "--num-rollout", "must be > 0")
    _require(a.num_epoch is None or a.num_epoch > 0, "--num-epoch", "must be > 0")
    _require(a.rm_type != "remote_rm" or a.rm_url is not None, "--rm-url", "is required with --rm-type remote_rm")
    for flag in ("rollout_request_timeout", "rollout_abort_timeout", "rollout_rpc_timeout"):
        _require(getattr(a, flag) > 0, "--" + flag.replace("_", "-"), "must be > 0")
    _require(a.reward_timeout > 0, "--reward-timeout", "must be > 0")
    _require(a.rollout_health_check_interval >= 0, "--rollout-health-check-interval", "must be >= 0 (0: off)")
    _require(a.rollout_health_check_timeout > 0, "--rollout-health-check-timeout", "must be > 0")
    _require(a.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait", "must be >= 0")
    _require(a.max_engine_restarts >= 0, "--max-engine-restarts", "must be >= 0")
    _require(a.max_consecutive_empty_steps > 0, "--max-consecutive-empty-steps", "must be > 0")

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
    _require(a.update_weight_buffer_size > 0, "--update-weight-buffer-size", "must be > 0")
    _require(a.eps_clip > 0 and a.eps_clip_high > 0, "--eps-clip", "clip ranges must be > 0")
    _require(0.0 <= a.gamma <= 1.0, "--gamma", "must be in [0, 1]")
    _require(a.eps_clip_c is None or a.eps_clip_c > 1.0, "--eps-clip-c", "must be > 1 (dual clip lower bound)")
    _require(a.tis_clip > 0 and 0 <= a.tis_clip_low < a.tis_clip, "--tis-clip",
             "need 0 <= --tis-clip-low < --tis-clip")
    _require(a.save_interval is None or (a.save_interval > 0 and a.save is not None), "--save-interval",
             "must be > 0 and needs --save")
    _require(a.load is None or _here(a, os.path.isdir(a.load)) or a.save == a.load, "--load",
             f"{a.load!r} is not a directory")
    _require(a.ckpt_step is None or (a.load is not None and a.ckpt_step >= 0), "--ckpt-step", "must be >= 0 and needs --load")

    _require(a.eval_prompt_data is None or len(a.eval_prompt_data) % 2 == 0, "--eval-prompt-data",
             "takes name/path pairs")
    for name, path in a.eval_datasets:
        _require(_here(a, os.path.isfile(path)), "--eval-prompt-data", f"{name}: {path!r} is not a file")
    _require(a.eval_interval is None or (a.eval_interval > 0 and a.eval_datasets), "--eval-interval",
             "must be > 0 and needs --eval-prompt-data")
    _require(a.n_samples_per_eval_prompt > 0, "--n-samples-per-eval-prompt", "must be > 0")
    validate_agent_args(a)
    validate_loss_args(a)
    validate_weight_update_interval(a, entry)
    if entry == "train_async.py":
        validate_async_args(a)


def validate_loss_args(a: Args) -> None:
    _require(a.loss_type != "custom_loss", "--loss-type custom_loss",
             "is not supported: upstream's custom loss function gets Megatron's vocabulary-sharded logits and upstream's "
             "batch dict, which this trainer does not build; use --loss-type policy_loss (shaped by "
             "--advantage-estimator, --eps-clip / --eps-clip-high / --eps-clip-c, --use-tis, --use-kl-loss, "
             "--entropy-coef, --calculate-per-token-loss) or sft_loss, with your reward in --custom-rm-path")


def validate_weight_update_interval(a: Args, entry: str) -> None:
    _require(a.update_weights_interval >= 1, "--update-weights-interval", "must be >= 1")
    _require(entry == "train_async.py" or a.update_weights_interval == 1, "--update-weights-interval",
             f"{a.update_weights_interval} is train_async.py's (engines that run behind the trainer); train.py pushes "
             "the new weights after every step (so does upstream's train.py, which never reads this flag), and with "
             "--colocate the engines drop their weights while the trainer trains, so they must get them back each step")


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
