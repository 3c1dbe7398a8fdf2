#!/usr/bin/env bash
# APRIL on Qwen3-8B (otherwise the paper's Qwen3-4B configuration).
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=qwen3-8B
EXPERIMENT=qwen3-8B-dapo-partial
EXPERIMENT_ARGS=(--partial-rollout --over-sampling-batch-size 64)
source "$(dirname "$0")/../../common.sh"
