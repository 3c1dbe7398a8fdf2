#!/usr/bin/env bash
# APRIL on DeepSeek-R1-Distill-Qwen-1.5B (otherwise the paper's Qwen3-4B configuration).
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=deepseek-r1-distill-qwen-1.5B
EXPERIMENT=deepseek-r1-distill-qwen-1.5B-dapo-partial
EXPERIMENT_ARGS=(--partial-rollout --over-sampling-batch-size 64)
source "$(dirname "$0")/../../common.sh"
