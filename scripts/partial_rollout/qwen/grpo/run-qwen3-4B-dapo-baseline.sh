#!/usr/bin/env bash
# Baseline of run-qwen3-4B-dapo-partial.sh: the same run without partial rollout (synchronous: 32 groups submitted, every one waited for).
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=qwen3-4B
EXPERIMENT=qwen3-4B-dapo-baseline
EXPERIMENT_ARGS=()
source "$(dirname "$0")/../../common.sh"
