#!/usr/bin/env bash
# APRIL with GSPO (sequence-level importance ratios; the GSPO paper's clip range 3e-4 / 4e-4).
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=qwen3-4B
EXPERIMENT=qwen3-4B-dapo-partial-gspo
EXPERIMENT_ARGS=(--partial-rollout --over-sampling-batch-size 64 --advantage-estimator gspo --eps-clip 3e-4 --eps-clip-high 4e-4)
source "$(dirname "$0")/../../common.sh"
