#!/usr/bin/env bash
# The one launcher behind scripts/partial_rollout/*/*/run-*.sh: the APRIL repository's setting
# (RLsys-Foundation/APRIL, scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh at a72b585), colocated on one
# node (every GPU holds a trainer rank and a share of an SGLang engine; the engines release their memory while the
# trainer trains, the trainer is offloaded while they generate, weights are handed over by CUDA IPC). bf16, the
# distributed optimizer and the offload are this project's defaults, as upstream forces them.
#
# Where it differs from APRIL's script, and why (tests/test_launch_scripts.py compares the two value by value):
#   --use-tis             resumed partial rollouts carry tokens of older policies: they are corrected by truncated
#                         importance sampling against their behaviour log-probs, never trained as on-policy
#   --save-interval 20    (APRIL: 20000, i.e. only at the end) the buffer of parked groups is checkpointed with the
#                         model, so a crash loses at most 20 steps and no parked group
#   no --use-kl-loss      APRIL passes it with --kl-loss-coef 0: the same loss, minus a reference model's forward pass
#   no --ref-load         APRIL's is a torch_dist conversion of the same weights; here --hf-checkpoint is read directly
#   W&B names             project slime-april, group $EXPERIMENT; the key only from WANDB_API_KEY (never a flag)
#   AMD-only flags        --no-gradient-accumulation-fusion is always the case here; not passed
#   parallel sizes of 1   APRIL spells out pipeline / context / expert sizes of 1 for a dense model; left out
#
# An experiment file sets MODEL (a file of scripts/models/), EXPERIMENT (a name) and EXPERIMENT_ARGS (what
# it changes), then sources this file; its own arguments reach train.py last (they win). Check a command line
# before spending GPUs with --dry-run (any machine; nothing starts): bash <experiment>.sh --dry-run
#
# Environment (nothing machine-specific is written here):
#   MODEL_DIR      Hugging Face checkpoint of $MODEL                                    (required)
#   DATA           DAPO-Math-17k as jsonl with "prompt" and "label"                     (required)
#   EVAL           AIME-2024 as jsonl with "prompt" and "label"                         (required)
#   SAVE           checkpoints (default runs/$EXPERIMENT/ckpt; resumed from when present)
#   NUM_GPUS       GPUs of the node (default 8)       ROLLOUT_TP   GPUs per SGLang engine (default 2, as APRIL)
#   TRAIN_BACKEND  megatron (default) or fsdp         TP           Megatron tensor parallel size (default 2)
#   NUM_EPOCH      passes over DATA (default 1)       NUM_ROLLOUT  rollout steps instead of NUM_EPOCH
#   PYTHON         interpreter (default python3)
#   WANDB_API_KEY  when set (read by wandb itself, never by this file), metrics also go to W&B online;
#                  WANDB_PROJECT (default slime-april), WANDB_GROUP (default $EXPERIMENT)
#
#   MODEL_DIR=/models/Qwen3-4B DATA=/data/dapo-math-17k.jsonl EVAL=/data/aime-2024.jsonl \
#     bash scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh
set -euo pipefail
: "${MODEL:?an experiment file sets MODEL before sourcing common.sh}"
: "${EXPERIMENT:?an experiment file sets EXPERIMENT before sourcing common.sh}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
source "scripts/models/${MODEL}.sh"  # MODEL_ARGS

: "${MODEL_DIR:?set MODEL_DIR to the Hugging Face checkpoint of ${MODEL}}"
: "${DATA:?set DATA to the DAPO-Math-17k jsonl (prompt, label)}"
: "${EVAL:?set EVAL to the AIME-2024 jsonl (prompt, label)}"
SAVE=${SAVE:-runs/${EXPERIMENT}/ckpt}
NUM_GPUS=${NUM_GPUS:-8}
TRAIN_BACKEND=${TRAIN_BACKEND:-megatron}

CLUSTER_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node "$NUM_GPUS" --colocate
  --rollout-num-gpus-per-engine "${ROLLOUT_TP:-2}"
  --rollout-backend sglang --train-backend "$TRAIN_BACKEND"
)
if [[ -n "${NUM_ROLLOUT:-}" ]]; then STEPS=(--num-rollout "$NUM_ROLLOUT"); else STEPS=(--num-epoch "${NUM_EPOCH:-1}"); fi
ROLLOUT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type deepscaler
  "${STEPS[@]}" --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 16384 --rollout-temperature 0.8
  --global-batch-size 256 --balance-data
)
EVAL_ARGS=(
  --eval-interval 10 --eval-prompt-data aime "$EVAL"
  --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7
)
ALGO_ARGS=(
  --advantage-estimator grpo --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28
  --use-tis
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
PERF_ARGS=(--use-dynamic-batch-size --max-tokens-per-gpu 9216)
if [[ $TRAIN_BACKEND == megatron ]]; then
  PERF_ARGS+=(
    --tensor-model-parallel-size "${TP:-2}" --sequence-parallel
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
    --attention-backend flash
  )
fi
SGLANG_ARGS=(--sglang-mem-fraction-static 0.6)
CKPT_ARGS=(--save "$SAVE" --load "$SAVE" --save-interval 20)
LOG_ARGS=(--run-dir "runs/${EXPERIMENT}" --wandb-project "${WANDB_PROJECT:-slime-april}"
          --wandb-group "${WANDB_GROUP:-$EXPERIMENT}")
if [[ -n "${WANDB_API_KEY:-}" ]]; then
  LOG_ARGS+=(--wandb-mode online)
fi

exec "${PYTHON:-python3}" train.py "${MODEL_ARGS[@]}" "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${PERF_ARGS[@]}" "${SGLANG_ARGS[@]}" "${CKPT_ARGS[@]}" "${LOG_ARGS[@]}" \
  "${EXPERIMENT_ARGS[@]}" "$@"
