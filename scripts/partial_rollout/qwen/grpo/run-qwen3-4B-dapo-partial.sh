#!/usr/bin/env bash
# GRPO/DAPO on Qwen3-4B with APRIL partial rollouts, one 8-GPU node:
# 4 GPUs train (FSDP2), 4 GPUs serve SGLang engines behind sglang-router.
# Run inside the docker image (docker/Dockerfile). Paths are overridable:
#   MODEL_DIR=/models/Qwen3-4B DATA=/data/dapo-math-17k.jsonl EVAL=/data/aime-2024.jsonl bash $0
set -euo pipefail
cd "$(dirname "$0")/../../../.."

MODEL_DIR=${MODEL_DIR:-/root/Qwen3-4B}
DATA=${DATA:-/root/dapo-math-17k/dapo-math-17k.jsonl}
EVAL=${EVAL:-/root/aime-2024/aime-2024.jsonl}
SAVE=${SAVE:-/root/ckpt/qwen3-4B-dapo-partial}

CLUSTER_ARGS=(
  --actor-num-nodes 1 --actor-num-gpus-per-node 4
  --rollout-num-gpus 4 --rollout-num-gpus-per-engine 1
  --rollout-backend sglang --train-backend fsdp
)
ROLLOUT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --prompt-data "$DATA" --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type deepscaler
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 1.0
  --global-batch-size 256
)
APRIL_ARGS=(
  --partial-rollout --over-sampling-batch-size 64
  --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
  --max-staleness 4 --staleness-policy mask
  --use-tis --tis-clip 2.0
)
EVAL_ARGS=(
  --eval-interval 20 --eval-prompt-data aime "$EVAL"
  --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7
)
ALGO_ARGS=(
  --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28
  --use-kl-loss --kl-loss-coef 0.0 --kl-loss-type low_var_kl --entropy-coef 0.0
  --calculate-per-token-loss
)
TRAIN_ARGS=(
  --lr 1e-6 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 --clip-grad 1.0
  --use-dynamic-batch-size --max-tokens-per-gpu 9216
  --save "$SAVE" --load "$SAVE" --save-interval 20
)
SGLANG_ARGS=(
  --sglang-mem-fraction-static 0.7 --sglang-server-concurrency 256
)
LOG_ARGS=(--use-wandb --wandb-project slime-april --wandb-group qwen3-4B-dapo-partial)

python train.py "${CLUSTER_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${APRIL_ARGS[@]}" "${EVAL_ARGS[@]}" \
  "${ALGO_ARGS[@]}" "${TRAIN_ARGS[@]}" "${SGLANG_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
