"""Upstream slime's flags that this project does not take: `parse_args` refuses each with what to use instead
(docs/upstream-flags.md lists them and the ones taken)."""

from __future__ import annotations

_CRITIC = "there is no critic here (--advantage-estimator grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline)"
_MOE = "MoE models are not supported yet (dense Qwen3 / Qwen2 / Llama models)"
_MLA = "multi-latent attention (DeepSeek V2 / V3) is not supported yet"
_CI = "upstream's CI switch; this project's checks are its test suite"
_WEIGHT_SYNC = "weight sync is chosen with --update-weight-mode tensor (colocated) | distributed (NCCL broadcast) | disk"
_LOGGING = "metrics go to RUN_DIR/metrics.jsonl and wandb (--use-wandb, --wandb-mode); samples with --save-debug-rollout-data"
_SAMPLES = ("not supported: drop groups with --dynamic-sampling-filter-path, shape samples in "
            "--custom-generate-function-path or --rollout-function-path")
_MEGATRON_MODEL = "the Megatron model is built from --hf-checkpoint's config.json (megatron-core's local layers)"
_PIPELINE = "pipeline parallelism is not supported yet; use tensor / data parallelism"
_OPD = "on-policy distillation is not supported yet"
_MEMORY = "not supported: the colocate/* and perf/ metrics report memory moved and time per phase"

REFUSED: dict[str, str] = {
    # rollout and data
    "--disable-rollout-global-dataset": "every rollout draws its prompts from --prompt-data; a rollout with its own "
                                        "prompts: --rollout-function-path",
    "--data-source-path": "prompts come from --prompt-data (jsonl / parquet); a rollout with its own prompts: "
                          "--rollout-function-path",
    "--mask-offpolicy-in-partial-rollout": "use --max-staleness 0 --staleness-policy mask: every token knows the policy "
                                           "version that produced it, and a resumed sample's older tokens leave the loss",
    "--rollout-task-type": "not needed: the task is the reward (--rm-type or --custom-rm-path)",
    "--min-batch-collection-ratio": "a step collects --rollout-batch-size groups; with --partial-rollout the rest is "
                                    "parked and resumed first",
    "--rollout-buffer-url": "an external rollout buffer is not supported: the run owns its buffer (--partial-rollout)",
    "--fetch-trajectory-retry-times": "an external rollout buffer is not supported: the run owns its buffer",
    "--rollout-external-engine-addrs": "external engines are not supported yet; --sglang-router-ip / --sglang-router-port "
                                       "attach to a running router",
    "--rollout-data-transport": "not needed: groups reach the trainers through Ray's object store",
    "--apply-chat-template-kwargs": "not supported: --apply-chat-template uses the tokenizer's own template",
    "--multimodal-keys": "multimodal data is not supported yet",
    "--tool-key": "tool schemas in the prompt data are not supported yet",
    "--loss-mask-type": "not needed: each sample carries its loss mask (a generate function sets tool tokens to 0)",
    "--data-pad-size-multiplier": "not needed: sequences are packed without padding to a multiple",
    "--http-proxy": "not supported: engines and the router are reached directly",
    "--use-distributed-post": "not needed: requests go through one client session per rollout",
    "--load-forge-rollout-data": "use --load-debug-rollout-data (a --save-debug-rollout-data dump)",
    "--load-debug-rollout-data-subsample": "not supported: --load-debug-rollout-data replays whole steps",
    "--save-debug-train-data": "use --save-debug-rollout-data (the groups each step trains on)",
    "--dump-details": "use --save-debug-rollout-data and RUN_DIR/rollout_trace.jsonl",
    "--start-rollout-id": "resume with --load: the checkpoint holds the step, the data position and the buffer",
    "--over-sampling-filter-path": "filter each finished group with --dynamic-sampling-filter-path (the step over-samples "
                                   "with --over-sampling-batch-size and stops at its target)",
    "--over-sampling-filter-input-size": "filter each finished group with --dynamic-sampling-filter-path",
    "--use-http2": "not needed: requests go through one keep-alive client session per rollout",
    # plugins
    "--custom-advantage-function-path": "advantages are --advantage-estimator's (grpo, gspo, reinforce_plus_plus, "
                                        "reinforce_plus_plus_baseline)",
    "--custom-convert-samples-to-train-data-path": _SAMPLES,
    "--custom-rollout-log-function-path": _LOGGING,
    "--custom-eval-rollout-log-function-path": _LOGGING,
    "--custom-loss-function-path": "upstream's custom loss gets Megatron's sharded logits and upstream's batch dict, "
                                   "which this trainer does not build; use --loss-type policy_loss (shaped by "
                                   "--advantage-estimator, --eps-clip*, --use-tis, --use-kl-loss, --entropy-coef) or "
                                   "sft_loss, with your reward in --custom-rm-path",
    "--custom-pg-loss-reducer-function-path": "--calculate-per-token-loss chooses the token mean (else the sample mean)",
    "--custom-reward-post-process-path": "rewards are normalized by --advantage-estimator (--disable-grpo-std-normalization "
                                         "keeps their scale)",
    "--custom-tis-function-path": "use --use-tis with --tis-clip / --tis-clip-low (per-token truncated importance sampling)",
    "--custom-update-weight-post-write-path": _WEIGHT_SYNC,
    "--custom-megatron-init-path": _MEGATRON_MODEL,
    "--custom-megatron-before-log-prob-hook-path": _MEGATRON_MODEL,
    "--custom-megatron-before-train-step-hook-path": _MEGATRON_MODEL,
    "--custom-model-provider-path": _MEGATRON_MODEL,
    "--custom-config-path": _MEGATRON_MODEL,
    "--megatron-config-path": "Megatron flags are passed on the command line",
    "--rollout-all-samples-process-path": _SAMPLES,
    "--rollout-data-postprocess-path": _SAMPLES,
    "--rollout-sample-filter-path": "not supported: a plugin (--custom-generate-function-path, --custom-rm-path, "
                                    "--dynamic-sampling-filter-path) sets sample.remove_sample = True itself (out of "
                                    "the loss, still in its group, as upstream)",
    "--rollout-sample-hook-path": _SAMPLES,
    # eval
    "--eval-config": "use --eval-prompt-data name path [name path ...] with the --eval-* sampling flags",
    "--eval-input-key": "eval sets are read with --input-key / --label-key",
    "--eval-label-key": "eval sets are read with --input-key / --label-key",
    "--eval-tool-key": "tool schemas in the prompt data are not supported yet",
    "--eval-max-prompt-len": "eval prompts follow --rollout-max-prompt-len",
    "--eval-min-new-tokens": "not supported: eval responses are bounded by --eval-max-response-len only",
    "--eval-reward-key": "use --reward-key (training and eval share it)",
    # algorithm and training
    "--use-rollout-logprobs": "the trainer computes the old policy's log-probs every step (with one optimizer step per "
                              "rollout, at the update's own forward); off-policy tokens are corrected against the "
                              "rollout's log-probs with --use-tis",
    "--use-opsm": "use --max-staleness with --staleness-policy (per-token versions) and --use-tis",
    "--opsm-delta": "use --max-staleness with --staleness-policy (per-token versions) and --use-tis",
    "--use-unbiased-kl": "use --kl-loss-type k1 | k2 | k3 | low_var_kl",
    "--use-rollout-entropy": "not supported: the loss's entropy term is --entropy-coef",
    "--disable-rewards-normalization": "GRPO subtracts the group mean; --disable-grpo-std-normalization keeps the scale",
    "--disable-compute-advantages-and-returns": "use --loss-type sft_loss to train without advantages",
    "--lambd": _CRITIC,
    "--value-clip": _CRITIC,
    "--num-critic-only-steps": _CRITIC,
    "--keep-old-actor": "not needed: the trainer computes the old policy's log-probs at the start of each step (with "
                        "one optimizer step per rollout, at the update's own forward)",
    "--ref-update-interval": "not supported: the reference model stays at --ref-load",
    "--ref-ckpt-step": "give --ref-load the checkpoint directory itself",
    "--reset-optimizer-states": "not supported: the optimizer keeps its state across steps",
    "--use-stateless-adam": "not supported: --optimizer adam keeps its moments",
    "--no-save-optim": "not supported: checkpoints hold the optimizer, so a resume is exact",
    "--async-save": "not supported: checkpoints are written atomically before the run goes on",
    "--freeze-params-name-list": "not supported: every parameter trains",
    "--only-train-params-name-list": "not supported: every parameter trains",
    "--recompute-loss-function": "use --recompute-granularity / --recompute-method / --recompute-num-layers",
    "--ref-micro-batch-size": "the reference model's log-probs are computed in the training micro-batches",
    "--log-probs-max-tokens-per-gpu": "log-probs are computed in the training micro-batches (--max-tokens-per-gpu)",
    "--balance-by-flops": "micro-batches are packed by tokens (--use-dynamic-batch-size --max-tokens-per-gpu); "
                          "--balance-data balances data-parallel ranks",
    "--enable-mtp-training": "multi-token prediction is not supported",
    "--mtp-num-layers": "multi-token prediction is not supported",
    "--mtp-loss-scaling-factor": "multi-token prediction is not supported",
    "--use-routing-replay": _MOE,
    "--use-rollout-routing-replay": _MOE,
    "--release-train": "use --offload (the trainer's state leaves the GPU while the engines generate)",
    "--train-env-vars": "set the environment of the job: Ray workers get the driver's (slime/utils/run.py)",
    "--num-gpus-per-node": "use --actor-num-gpus-per-node (and --rollout-num-gpus without --colocate)",
    "--model-name": "not needed: the model type is read from --hf-checkpoint's config.json",
    "--save-hf": "use tools/export_hf.py on a --save checkpoint",
    "--check-weight-update-equal": _CI,
    "--ci-test": _CI,
    "--ci-disable-kl-checker": _CI,
    "--ci-load-grad-norm": _CI,
    "--ci-save-grad-norm": _CI,
    "--ci-train-rollout-logprob-abs-diff-threshold": _CI,
    # engines
    "--sglang-config": "upstream's engine-deployment YAML (server groups for prefill/decode disaggregation) is not "
                       "supported: every engine is one SGLang server of --rollout-num-gpus-per-engine GPUs; give SGLang's "
                       "own flags as --sglang-<flag>",
    "--prefill-num-servers": "prefill/decode disaggregation is not supported: every engine is one SGLang server",
    # weight sync
    "--update-weight-transport": _WEIGHT_SYNC,
    "--update-weight-delta-checksum": _WEIGHT_SYNC,
    "--update-weight-delta-encoding": _WEIGHT_SYNC,
    "--update-weight-disk-dir": _WEIGHT_SYNC,
    "--update-weight-disk-keep-files": _WEIGHT_SYNC,
    "--update-weight-local-checkpoint-dir": _WEIGHT_SYNC,
    # on-policy distillation, other models
    "--use-opd": _OPD, "--opd-type": _OPD, "--opd-kl-coef": _OPD, "--opd-teacher-load": _OPD,
    "--opd-teacher-ckpt-step": _OPD,
    "--qwen-gdn-backend": "Qwen3-Next (linear attention) is not supported yet",
    "--freeze-indexer": "DeepSeek V3.2's indexer is not supported",
    "--megatron-deepgemm-forward-layers": "FP8 DeepGEMM is not supported (--bf16)",
    "--megatron-deepgemm-forward-modules": "FP8 DeepGEMM is not supported (--bf16)",
    "--megatron-deepgemm-moe-forward-layers": _MOE,
    "--megatron-deepgemm-moe-forward-modules": _MOE,
    "--padded-vocab-size": "not needed: the vocabulary is padded to a multiple of --make-vocab-size-divisible-by",
    # logging and profiling
    "--use-tensorboard": _LOGGING, "--tb-project-name": _LOGGING, "--tb-experiment-name": _LOGGING,
    "--wandb-dir": "wandb files go under --run-dir",
    "--wandb-host": "set WANDB_BASE_URL in the environment",
    "--wandb-team": "set WANDB_ENTITY in the environment",
    "--wandb-run-id": "not supported: a resumed run (--load) continues RUN_DIR/metrics.jsonl in a new wandb run",
    "--disable-wandb-random-suffix": "not supported: wandb runs are grouped by --wandb-group",
    "--wandb-always-use-train-step": "metrics are logged at the rollout step",
    "--log-passrate": _LOGGING, "--log-correct-samples": _LOGGING, "--log-multi-turn": _LOGGING,
    "--log-reward-category": _LOGGING,
    "--profile-target": _MEMORY, "--memory-recorder": _MEMORY, "--memory-snapshot-dir": _MEMORY,
    "--memory-snapshot-num-steps": _MEMORY, "--record-memory-history": _MEMORY,
    # Megatron flags upstream scripts pass that this backend does not have
    "--allgather-cp": "context parallelism is not supported yet (--context-parallel-size 1)",
    "--decoder-first-pipeline-num-layers": _PIPELINE,
    "--decoder-last-pipeline-num-layers": _PIPELINE,
    "--spec": _MEGATRON_MODEL,
    "--use-precision-aware-optimizer": "use --offload (optimizer state off the GPU while the engines generate)",
    "--optimizer-cpu-offload": "use --offload (optimizer state off the GPU while the engines generate)",
    "--overlap-cpu-optimizer-d2h-h2d": "use --offload (optimizer state off the GPU while the engines generate)",
    "--lr-warmup-fraction": "use --lr-warmup-iters",
    "--seq-length": "not needed: lengths come from the data and --rollout-max-response-len",
    "--no-check-for-nan-in-loss-and-grad": "not supported: a NaN in the loss stops the step and names it",
    "--fp8-format": "FP8 training is not supported (--bf16)",
    "--fp8-recipe": "FP8 training is not supported (--bf16)",
    "--fp8-param-gather": "FP8 training is not supported (--bf16)",
    "--deterministic-mode": "not supported",
    "--distributed-backend": "chosen from the device: nccl on GPUs, gloo on CPU",
    "--distributed-timeout-minutes": "not supported",
    "--apply-layernorm-1p": _MEGATRON_MODEL,
    "--post-self-attn-layernorm": _MEGATRON_MODEL,
    "--post-mlp-layernorm": _MEGATRON_MODEL,
    "--use-gated-attention": "Qwen3-Next (gated attention) is not supported yet",
    "--attention-output-gate": "Qwen3-Next (gated attention) is not supported yet",
    "--rotary-interleaved": _MEGATRON_MODEL,
    "--no-position-embedding": "use --position-embedding-type none",
    "--multi-latent-attention": _MLA, "--q-lora-rank": _MLA, "--kv-lora-rank": _MLA, "--qk-head-dim": _MLA,
    "--qk-pos-emb-head-dim": _MLA, "--v-head-dim": _MLA, "--mscale": _MLA, "--mscale-all-dim": _MLA,
    "--num-experts": _MOE, "--moe-ffn-hidden-size": _MOE, "--moe-router-topk": _MOE, "--moe-router-score-function": _MOE,
    "--moe-router-dtype": _MOE, "--moe-permute-fusion": _MOE, "--moe-layer-freq": _MOE, "--moe-grouped-gemm": _MOE,
    "--moe-token-dispatcher-type": _MOE, "--moe-aux-loss-coeff": _MOE, "--moe-enable-deepep": _MOE,
    "--moe-shared-expert-intermediate-size": _MOE, "--moe-router-pre-softmax": _MOE,
    "--moe-router-load-balancing-type": _MOE, "--moe-router-enable-expert-bias": _MOE,
    "--moe-router-bias-update-rate": _MOE, "--moe-router-topk-scaling-factor": _MOE, "--moe-token-drop-policy": _MOE,
    "--moe-router-num-groups": _MOE, "--moe-router-group-topk": _MOE, "--moe-shared-expert-gate": _MOE,
}


_SHAPE = "optional: the model is built from --hf-checkpoint's config.json; a flag given must agree with it"
_WANDB = ("on, offline (metrics never leave the machine unless --wandb-mode online or --wandb-key / WANDB_API_KEY); "
          "--no-use-wandb: metrics.jsonl only")

# Upstream's defaults that differ here: flag -> (upstream's, here and why), from its slime/utils/arguments.py at
# 624b824 and Megatron-LM's defaults; every other flag taken has upstream's default (tests/test_upstream_defaults.py).
DEFAULTS_DIFFER: dict[str, tuple[str, str]] = {
    "--actor-num-gpus-per-node": ("8", "1: one trainer process (one GPU) unless a script says how many"),
    "--rollout-num-gpus": ("unset (every trainer GPU with --colocate)", "every trainer GPU with --colocate, as "
                           "upstream; otherwise 1"),
    "--train-backend": ("megatron (the only one)", "auto: megatron where megatron-core and GPUs are, else fsdp (CPU)"),
    "--input-key": ("input", "prompt (the DAPO-Math-17k / AIME-2024 files' key; every upstream script passes it)"),
    "--rollout-max-response-len": ("unset (SGLang's own max_new_tokens)", "1024: a partial rollout needs a budget"),
    "--rollout-health-check-interval": ("30", "10 seconds (an engine that dies mid-step is named sooner)"),
    "--log-probs-chunk-size": ("-1 (the whole micro-batch)", "0: auto-sized chunks, so that no [tokens, vocabulary] "
                               "logits are held (same values)"),
    "--global-batch-size": ("Megatron-LM's micro-batch x data-parallel size", "--rollout-batch-size x "
                            "--n-samples-per-prompt: one optimizer step per rollout (upstream's scripts pass 256, "
                            "= 32 x 8)"),
    "--weight-decay": ("0.01 (Megatron-LM)", "0.0; upstream's RL scripts pass 0.1"),
    "--adam-beta2": ("0.999 (Megatron-LM)", "0.98, what upstream's RL scripts pass"),
    "--lr-decay-style": ("linear (Megatron-LM)", "constant, what upstream's RL scripts pass"),
    "--attention-dropout": ("0.1 (Megatron-LM)", "the config.json's attention_dropout (0.0 for Qwen3); upstream's "
                            "scripts pass 0.0"),
    "--hidden-dropout": ("0.1 (Megatron-LM)", "0.0; upstream's scripts pass 0.0"),
    "--attention-backend": ("auto (Megatron-LM picks Transformer Engine's kernels)", "auto: torch SDPA (flash kernels on "
                            "GPUs); fused (Transformer Engine) is refused"),
    "--transformer-impl": ("transformer_engine (Megatron-LM)", "auto: Transformer Engine where it imports on a CUDA "
                           "machine, else megatron-core's local layers"),
    "--rotary-scaling-factor": ("1.0 (Megatron-LM)", "unset: rope scaling is not supported (a value is refused)"),
    "--make-vocab-size-divisible-by": ("128, the vocabulary padded to a multiple of 128 x TP", "128, padded to a "
                                       "multiple of lcm(128, TP): one shape for every TP, so checkpoints reshard"),
    "--num-layers": ("required", _SHAPE), "--hidden-size": ("required", _SHAPE),
    "--ffn-hidden-size": ("required", _SHAPE), "--num-attention-heads": ("required", _SHAPE),
    "--num-query-groups": ("the number of heads (Megatron-LM)", _SHAPE),
    "--kv-channels": ("hidden / heads (Megatron-LM)", _SHAPE),
    "--vocab-size": ("from the tokenizer", _SHAPE), "--max-position-embeddings": ("4096 (upstream's seq-length)", _SHAPE),
    "--norm-epsilon": ("1e-5 (Megatron-LM)", _SHAPE), "--rotary-base": ("10000 (Megatron-LM)", _SHAPE),
    "--normalization": ("LayerNorm (Megatron-LM)", _SHAPE),
    "--position-embedding-type": ("learned_absolute (Megatron-LM)", _SHAPE),
    "--swiglu": ("off", _SHAPE), "--group-query-attention": ("off", _SHAPE), "--qk-layernorm": ("off", _SHAPE),
    "--add-qkv-bias": ("off", _SHAPE), "--disable-bias-linear": ("off", _SHAPE),
    "--untie-embeddings-and-output-weights": ("off", _SHAPE), "--use-rotary-position-embeddings": ("off", _SHAPE),
    "--use-wandb": ("off", _WANDB),
    "--wandb-mode": ("unset (wandb's own: online when logged in)", "offline, or online with --wandb-key / "
                     "WANDB_API_KEY"),
    "--wandb-project": ("unset", "slime-april"),
    "--update-weight-mode": ("full (with --update-weight-transport nccl)", "tensor with --colocate, else distributed: "
                             "this project's values (tensor, distributed, disk); full / delta stop with the mapping"),
    "--router-policy": ("cache_aware (sglang-router's)", "round_robin (its other name here: --sglang-router-policy)"),
    "--sglang-router-request-timeout-secs": ("14400", "unset: sglang-router's own 1800 s (a request is bounded by "
                                             "--rollout-request-timeout, 1800 s, on our side)"),
    "--router-balance-abs-threshold": ("10", "sglang-router's own 64 (it matters for cache_aware only)"),
    "--router-balance-rel-threshold": ("1.2", "sglang-router's own 1.5 (it matters for cache_aware only)"),
}

# the model-shape flags among them (optional here: read from config.json)
MODEL_SHAPE_FLAGS = tuple(flag for flag, (_, here) in DEFAULTS_DIFFER.items() if here == _SHAPE)


def refusal(flag: str) -> str | None:
    """What to use instead of upstream slime's `flag` (`--name` or `--name=value`), or None if it is not one."""
    return REFUSED.get(flag.split("=", 1)[0])


__all__ = ["DEFAULTS_DIFFER", "MODEL_SHAPE_FLAGS", "REFUSED", "refusal"]
