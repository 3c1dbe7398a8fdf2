#!/usr/bin/env bash
# README's main-job command: install (idempotent), build the embedded subtract_chain task and a tiny
# Qwen3, warm-start it with supervised training (cached), then run GRPO with APRIL partial rollouts
# through train.py on the embedded engine behind sglang-router. CPU only, ~6 minutes on 2 cores the
# first time (~2 once the warm start is cached).
#
#   bash scripts/quickstart.sh                 # APRIL (partial rollout, over-sampling)
#   bash scripts/quickstart.sh --no-partial    # the same job, synchronous, for comparison
#   STEPS=20 bash scripts/quickstart.sh        # fewer steps; extra arguments go to train.py
#   bash scripts/quickstart.sh --train-backend megatron   # the same job on the Megatron-core trainer
#   SIMULATE=0 bash scripts/quickstart.sh      # plots without calibrating the engine for the simulator (~20 s less)
#   MAX_STALENESS= bash scripts/quickstart.sh  # APRIL without the staleness cap (default: 4 policy versions)
#   bash scripts/quickstart.sh --agentic       # multi-turn tool use: a calculator, partial rollouts (docs/multi-turn.md)
#   bash scripts/quickstart.sh --real-model    # a real model: SmolLM2-135M-Instruct learns arithmetic (docs/real-model.md)
#   STEPS=6 bash scripts/quickstart.sh --rollout-backend sglang   # on SGLang's own server (CPU: its venv is built once)
#
# It ends by writing pictures of the run into $RUN/plots/ (tools/plot_run.py): reward and eval accuracy,
# rollout tokens/s, off-policy tokens and staleness, response lengths, engine occupancy over one rollout
# (beside the other mode's run when both exist) and the rollout simulator's prediction vs the measurement.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# --agentic: the multi-turn tool-use quick start (scripts/quickstart_agentic.sh, docs/multi-turn.md)
if [[ "${1:-}" == "--agentic" ]]; then shift; exec bash scripts/quickstart_agentic.sh "$@"; fi
# --real-model: SmolLM2-135M-Instruct on reasoning-gym arithmetic (scripts/quickstart_real_model.sh, docs/real-model.md)
if [[ "${1:-}" == "--real-model" ]]; then shift; exec bash scripts/quickstart_real_model.sh "$@"; fi

MODE=april
if [[ "${1:-}" == "--no-partial" ]]; then MODE=sync; shift; fi
WORK=${WORK:-runs/tiny}
RUN=${RUN:-runs/quickstart-$MODE}
STEPS=${STEPS:-80}
EVAL_INTERVAL=${EVAL_INTERVAL:-20}

# SLIME_SKIP_INSTALL=1: the package is already installed (tests, benchmarks, worktrees that must not
# re-point an editable install at themselves)
[[ "${SLIME_SKIP_INSTALL:-0}" == 1 ]] || bash scripts/install.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

# --rollout-backend sglang: SGLang's own server. Without CUDA (or without sglang in this Python) it runs from its own
# venv, built once by tools/sglang_cpu_env.py (4-6 minutes the first time); --sglang-python / $SLIME_SGLANG_PYTHON
# name another interpreter.
if [[ " $* " == *" --rollout-backend sglang "* ]]; then
  SIMULATE=${SIMULATE:-0}  # the simulator's calibration measures the embedded engine, not SGLang's server
  if [[ -z "${SLIME_SGLANG_PYTHON:-}" && " $* " != *" --sglang-python "* ]] && ! $PY -c 'import sglang' >/dev/null 2>&1; then
    $PY tools/sglang_cpu_env.py install
    export SLIME_SGLANG_PYTHON=$($PY tools/sglang_cpu_env.py python)
  fi
fi

# Data, tokenizer, model and the supervised warm start (skipped when cached with the same settings).
$PY tools/prepare_tiny_task.py --out "$WORK" ${PREPARE_ARGS:-}

# APRIL resumes parked samples, so some trained tokens come from older policies (TIS corrects them). The cap keeps
# them recent: a parked sample holding a token more than MAX_STALENESS versions older than the policy being trained
# is regenerated from its prompt. Without it, a sample parked again and again here trains tokens ~28 versions old.
MAX_STALENESS=${MAX_STALENESS-4}
if [[ $MODE == april ]]; then
  ROLLOUT_MODE=(--partial-rollout --over-sampling-batch-size 16)
  [[ -z $MAX_STALENESS ]] || ROLLOUT_MODE+=(--max-staleness "$MAX_STALENESS" --staleness-policy restart)
else
  ROLLOUT_MODE=()
fi

rm -rf "$RUN"
$PY train.py \
  --hf-checkpoint "$WORK/model-sft" \
  --prompt-data "$WORK/train.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --rollout-shuffle --rollout-seed 1 --seed 1 \
  --rm-type subtract_chain \
  --num-rollout "$STEPS" --rollout-batch-size 8 --n-samples-per-prompt 8 \
  --rollout-max-response-len 192 --rollout-temperature 1.0 \
  "${ROLLOUT_MODE[@]}" \
  --advantage-estimator grpo --calculate-per-token-loss --use-tis \
  --lr 1e-4 --global-batch-size 64 --micro-batch-size 16 \
  --eval-prompt-data tiny "$WORK/eval.jsonl" --eval-interval "$EVAL_INTERVAL" \
  --eval-temperature 1.0 --eval-max-response-len 192 \
  --save "$RUN/ckpt" --save-interval "$STEPS" \
  --run-dir "$RUN" \
  "$@"

# Pictures. The simulator's prediction needs the engine's costs: calibrate it once on this machine (~20 s).
if [[ "${SIMULATE:-1}" != 0 ]]; then
  $PY tools/simulate_rollout.py calibrate --model-path "$WORK/model-sft" --quick --passes 2 --curve "" \
    --out "$RUN/cost_model.json" || echo "[quickstart] engine calibration failed: plotting without the simulator" >&2
fi
$PY tools/plot_run.py "$RUN"
