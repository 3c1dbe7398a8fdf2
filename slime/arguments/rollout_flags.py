"""The flags of the cluster, the rollout and its engines (argparse groups; defaults written here)."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import _AGENT_DEFAULTS, BUILTIN_MULTI_TURN_GENERATE, BUILTIN_ROLLOUT_FUNCTION


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
                        "stream with --admission fixed: --rollout-batch-size x --n-samples-per-prompt, at most that); "
                        "with --admission auto, the most it may keep in flight")
    g.add_argument("--admission", choices=["auto", "fixed"], default=None,
                   help="pool and stream modes: fixed keeps --rollout-pool-size requests in flight; auto adjusts them "
                        "from the engines' load reports (/v1/loads: KV usage, queue, retractions; AIMD-like, "
                        "slime/rollout/admission.py) up to --rollout-pool-size. Default: auto, or fixed when "
                        "--rollout-pool-size is given")
    g.add_argument("--max-staleness", type=int, default=None,
                   help="largest allowed lag (policy versions) of a resumed token behind the current policy")
    g.add_argument("--staleness-policy", choices=["restart", "mask", "keep"], default="restart",
                   help="what happens to a resumed sample over --max-staleness")
    g.add_argument("--reuse-stale-kv", action="store_true",
                   help="weight updates keep the engines' cache (flush_cache=false), so a parked sample resumes on "
                        "the KV its earlier tokens had (computed by older weights) instead of being re-prefilled; "
                        "its tokens keep their versions and go through the same off-policy correction")
    g.add_argument("--pause-mode", choices=PAUSE_MODES, default="abort",
                   help="train_async.py: how a weight update reaches the requests in flight (SGLang's /pause_generation "
                        "modes). abort: they are aborted, wait, and resume from their tokens under the new version "
                        "(re-prefilled); retract: the engines keep them, free their KV and prefill them again after the "
                        "update; in_place: the engines keep them with their KV and go on (nothing re-prefilled; tokens "
                        "sampled after the update attend to KV of older weights, are labelled with the version that "
                        "sampled them and corrected by TIS; the update keeps the cache, flush_cache=false). Every token "
                        f"keeps its version and --max-staleness holds in each mode. Default: {ASYNC_PAUSE_MODE} with "
                        "train_async.py (benchmarks/README.md: chosen by measurement), abort with train.py (its updates "
                        "find the engines idle: nothing in flight to pause)")


PAUSE_MODES = ("abort", "retract", "in_place")
# train_async.py's default --pause-mode, chosen by measurement (benchmarks/README.md, its `--pause-mode` row)
ASYNC_PAUSE_MODE = "in_place"


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


def _add_reward_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reward")
    g.add_argument("--rm-type", type=str, default=None,
                   help="deepscaler | dapo | math | boxed_<type> | remote_rm | subtract_chain")
    g.add_argument("--custom-rm-path", type=str, default=None)
    g.add_argument("--rm-url", type=str, default=None)
    g.add_argument("--group-rm", action="store_true")
    g.add_argument("--reward-timeout", type=float, default=60.0, help="seconds before a reward counts as failed")
    g.add_argument("--reward-key", type=str, default=None, help="key of a dict reward used by filters and advantages")


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


def _add_async_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("asynchronous training (train_async.py)")
    g.add_argument("--max-async-lag", type=int, default=1,
                   help="how many policy versions the rollout may run ahead of the trainer: a batch trained at "
                        "version P is collected while the engines serve versions >= P - lag (backpressure beyond)")


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
