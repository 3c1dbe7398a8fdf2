#!/usr/bin/env bash
# The agentic quick start (`bash scripts/quickstart.sh --agentic` runs this): a tiny Qwen3 learns, on CPU,
# to call a calculator while it writes a subtract chain (slime/tasks/subtract_tool.py, docs/multi-turn.md).
# Multi-turn trajectories (model turns, tool calls, observations with loss mask 0) go through APRIL:
# partial rollouts with over-sampling, so trajectories are parked mid-turn or with a call running, and
# resumed next step. ~7 minutes on 2 cores the first time (a ~5-minute warm start, then cached), 2-4 after.
#
#   bash scripts/quickstart.sh --agentic                     # train.py, APRIL
#   STEPS=20 bash scripts/quickstart.sh --agentic            # fewer steps; extra arguments go to train.py
#   ENTRY=train_async.py bash scripts/quickstart.sh --agentic --rollout-mode stream   # stream mode
#
# The summary prints eval accuracy first -> last and the tool-call rate; metrics.jsonl carries rollout/tool/*
# and eval/tiny/tool/*; $RUN/plots/tools.png draws the tool-call rate beside eval accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

WORK=${WORK:-runs/tiny-tool}
RUN=${RUN:-runs/quickstart-agentic}
STEPS=${STEPS:-40}
EVAL_INTERVAL=${EVAL_INTERVAL:-10}
ENTRY=${ENTRY:-train.py}

[[ "${SLIME_SKIP_INSTALL:-0}" == 1 ]] || bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

# Data (chains with calls), tokenizer with the call markers, model and its warm start on a teacher that
# calls the calculator on some steps (skipped when cached with the same settings).
$PY tools/prepare_tiny_task.py --out "$WORK" --task subtract_tool ${PREPARE_ARGS:-}

# over-sampled chunks of 16 groups (APRIL); pool and stream modes keep --rollout-pool-size requests in flight instead
APRIL_FLAGS=(--over-sampling-batch-size 16)
[[ " $* " == *" --rollout-mode pool "* || " $* " == *" --rollout-mode stream "* ]] && APRIL_FLAGS=()
# the staleness cap, as the main quick start: a parked trajectory holding a model token more than MAX_STALENESS
# versions older than the policy being trained is regenerated from its prompt (MAX_STALENESS= runs uncapped)
MAX_STALENESS=${MAX_STALENESS-4}
[[ -z $MAX_STALENESS ]] || APRIL_FLAGS+=(--max-staleness "$MAX_STALENESS" --staleness-policy restart)

rm -rf "$RUN"
$PY "$ENTRY" \
  --hf-checkpoint "$WORK/model-sft" \
  --prompt-data "$WORK/train.jsonl" --input-key prompt --label-key label \
  --rollout-shuffle --rollout-seed 1 --seed 1 \
  --agent-env slime.tasks.subtract_tool.ENV --custom-rm-path slime.tasks.subtract_tool.reward \
  --max-turns 32 --tool-workers 2 --tool-timeout 10 \
  --num-rollout "$STEPS" --rollout-batch-size 8 --n-samples-per-prompt 8 \
  --rollout-max-response-len 192 --rollout-temperature 1.0 \
  --partial-rollout "${APRIL_FLAGS[@]}" \
  --advantage-estimator grpo --calculate-per-token-loss --use-tis \
  --lr 1e-4 --global-batch-size 64 --micro-batch-size 16 \
  --eval-prompt-data tiny "$WORK/eval.jsonl" --eval-interval "$EVAL_INTERVAL" \
  --eval-temperature 1.0 --eval-max-response-len 192 \
  --save "$RUN/ckpt" --save-interval "$STEPS" \
  --run-dir "$RUN" \
  "$@"

$PY tools/plot_run.py "$RUN"
