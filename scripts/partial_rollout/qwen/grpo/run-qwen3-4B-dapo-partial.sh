#!/usr/bin/env bash
# APRIL (the paper's configuration): Qwen3-4B, GRPO on DAPO-Math-17k, 64 prompt groups submitted for 32, the rest parked and resumed first.
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=qwen3-4B
EXPERIMENT=qwen3-4B-dapo-partial
EXPERIMENT_ARGS=(--partial-rollout --over-sampling-batch-size 64)
source "$(dirname "$0")/../../common.sh"
