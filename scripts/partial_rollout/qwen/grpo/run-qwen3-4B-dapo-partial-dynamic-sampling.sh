#!/usr/bin/env bash
# APRIL + DAPO dynamic sampling: groups whose rewards are all equal are dropped and replaced from the over-sampled ones.
# Environment and defaults: scripts/partial_rollout/common.sh. Extra arguments go to train.py.
MODEL=qwen3-4B
EXPERIMENT=qwen3-4B-dapo-partial-dynamic-sampling
EXPERIMENT_ARGS=(--partial-rollout --over-sampling-batch-size 64 --dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std)
source "$(dirname "$0")/../../common.sh"
