"""The rules of the flags, by group; each error names the flag and the rule. `validate_args`
(slime/arguments/__init__.py) runs them in order, after `validate_given_args` (what the user wrote, before the
defaults fill the gaps)."""

from __future__ import annotations

import math
import os

from slime.arguments.base import (_AGENT_DEFAULTS, BUILTIN_MULTI_TURN_GENERATE, BUILTIN_ROLLOUT_FUNCTION, ArgumentError,
                                  Args, _here, _require)
from slime.rollout.staleness import StalenessCap
from slime.utils.net import AUTO, WILDCARDS, interface_addresses, is_ip_address, is_loopback


def validate_given_args(a: Args) -> None:
    """Rules about what the user wrote, checked before defaults fill the gaps."""
    _require(a.over_sampling_batch_size is None or a.rollout_mode == "chunked", "--over-sampling-batch-size",
             f"sizes --rollout-mode chunked's over-sampled chunks; --rollout-mode {a.rollout_mode} keeps "
             "--rollout-pool-size requests in flight instead (drop --over-sampling-batch-size, or set --rollout-pool-size)")
    _require(a.admission != "auto" or a.rollout_mode in ("pool", "stream"), "--admission auto",
             "adjusts the requests a pool keeps in flight (--rollout-mode pool or stream); --rollout-mode chunked "
             "submits --over-sampling-batch-size groups at a time (--over-sampling-batch-size auto sizes them)")


def check_placement(a: Args) -> None:
    """Colocation, offload and how weights reach the engines."""
    _require(not a.offload or a.colocate, "--offload", "needs --colocate (the engines use the memory it frees)")
    _require(not a.offload_rollout or a.colocate, "--offload-rollout",
             "needs --colocate (engines release their memory for a trainer on the same devices)")
    _require(a.offload_rollout is not False or not a.colocate, "--no-offload-rollout",
             "contradicts --colocate: colocated engines release weights and KV cache while the trainer trains")
    _require(not a.update_weights_from_disk or a.update_weight_mode == "disk", "--update-weights-from-disk",
             f"contradicts --update-weight-mode {a.update_weight_mode}")
    _require(not (a.colocate and a.reuse_stale_kv), "--reuse-stale-kv",
             "contradicts --colocate: colocated engines release their KV cache while the trainer trains")
    _require(not a.colocate or a.actor_num_nodes == 1, "--colocate",
             "on more than one node is not built yet: engines are placed on every node's trainer bundles, but the "
             "weight handover by tensor (CUDA IPC / shared memory) and the device plan that feeds it are per node")
    _require(a.update_weight_mode != "tensor" or a.colocate, "--update-weight-mode tensor",
             "needs --colocate (tensors are handed over on the devices trainer and engines share)")


def check_model(a: Args) -> None:
    _require(a.hf_checkpoint is not None, "--hf-checkpoint", "is required (a local Hugging Face model directory)")
    _require(_here(a, os.path.isdir(a.hf_checkpoint)), "--hf-checkpoint", f"{a.hf_checkpoint!r} is not a directory")


def check_rollout(a: Args, entry: str) -> None:
    """The rollout: batch, lengths, sampling, over-sampling, engines, modes, the staleness cap."""
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
    _require(a.pause_mode == "abort" or entry == "train_async.py", f"--pause-mode {a.pause_mode}",
             "train.py updates the weights of idle engines (each step ends by aborting and parking what is in flight), "
             "so there is nothing to pause; requests run across updates in train_async.py")
    _require(a.rollout_mode != "stream" or a.partial_rollout, "--rollout-mode stream",
             "needs --partial-rollout (requests in flight at a checkpoint or an update are parked and resumed)")
    try:  # the cap checks its own values (--max-staleness, --staleness-policy)
        StalenessCap.from_args(a)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def check_cluster(a: Args) -> None:
    """Nodes, devices, threads and the address every server binds."""
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


def check_data(a: Args) -> None:
    """Prompts, rewards, how long the run is, debug data."""
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


def check_faults(a: Args) -> None:
    """Timeouts, health checks and restarts."""
    for flag in ("rollout_request_timeout", "rollout_abort_timeout", "rollout_rpc_timeout"):
        _require(getattr(a, flag) > 0, "--" + flag.replace("_", "-"), "must be > 0")
    _require(a.reward_timeout > 0, "--reward-timeout", "must be > 0")
    _require(a.rollout_health_check_interval >= 0, "--rollout-health-check-interval", "must be >= 0 (0: off)")
    _require(a.rollout_health_check_timeout > 0, "--rollout-health-check-timeout", "must be > 0")
    _require(a.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait", "must be >= 0")
    _require(a.max_engine_restarts >= 0, "--max-engine-restarts", "must be >= 0")
    _require(a.max_consecutive_empty_steps > 0, "--max-consecutive-empty-steps", "must be > 0")


def check_training(a: Args) -> None:
    """Batches, the optimizer, the loss's clips, checkpoints."""
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


def check_eval(a: Args) -> None:
    _require(a.eval_top_k == -1 or a.eval_top_k > 0, "--eval-top-k", "must be -1 (off) or > 0")
    _require(a.eval_prompt_data is None or len(a.eval_prompt_data) % 2 == 0, "--eval-prompt-data",
             "takes name/path pairs")
    for name, path in a.eval_datasets:
        _require(_here(a, os.path.isfile(path)), "--eval-prompt-data", f"{name}: {path!r} is not a file")
    _require(a.eval_interval is None or (a.eval_interval > 0 and a.eval_datasets), "--eval-interval",
             "must be > 0 and needs --eval-prompt-data")
    _require(a.n_samples_per_eval_prompt > 0, "--n-samples-per-eval-prompt", "must be > 0")


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


def validate_async_args(a: Args) -> None:
    """train_async.py's rules (its flags exist only in its parser)."""
    _require(a.max_async_lag >= 1, "--max-async-lag", "must be >= 1 (0 is synchronous training: use train.py)")
    _require(a.max_async_lag >= a.update_weights_interval, "--max-async-lag",
             f"({a.max_async_lag}) must be >= --update-weights-interval ({a.update_weights_interval}): between two "
             "updates the engines fall that many versions behind, and a batch can only be collected within the lag")
    _require(not a.colocate, "--colocate", "train_async.py overlaps rollout and training, so engines and trainers "
             "need their own devices; use train.py for colocated runs")
    _require(not a.use_fault_tolerance, "--use-fault-tolerance", "train_async.py does not restart engines under a "
             "running rollout yet (an engine fault stops the run, naming the engine); use train.py to restart them")
    for value, flag in ((a.debug_rollout_only, "--debug-rollout-only"), (a.debug_train_only, "--debug-train-only"),
                        (a.load_debug_rollout_data, "--load-debug-rollout-data")):
        _require(not value, flag, "has no rollout and training to overlap; use train.py")
    _require(a.rollout_mode != "stream" or a.rollout_function_path == BUILTIN_ROLLOUT_FUNCTION, "--rollout-function-path",
             f"--rollout-mode stream runs the built-in rollout ({BUILTIN_ROLLOUT_FUNCTION}), not {a.rollout_function_path}")
