#!/usr/bin/env bash
# The main job on one GPU, prepared so that a GPU lease is spent on measuring only: every stage runs here first,
# on CPU, with --cpu-dry-run (tests/test_gpu_main_job.py does that in CI).
#
#   bash benchmarks/gpu_main_job.sh --part engine   # GPU run 1 (~5 min; carries .whl/: the wheels and Ray's first part)
#   bash benchmarks/gpu_main_job.sh --part train    # GPU run 2, right after it (~5 min; carries .whl2/: Ray's second part)
#   bash benchmarks/gpu_main_job.sh --cpu-dry-run   # both parts on CPU, tiny settings (--part to pick one)
#
# part engine (no Ray needed):
#   E1 the embedded engine's decode step at 1 / 8 / 64 / 128 rows, the 0.5B preset in bf16, eager then with CUDA
#      graphs (engine_step.py --cuda-graph-mode off, then auto): the graphs' step at 1 row <= at 128 rows, and the
#      greedy tokens of one prompt and of 5 together unchanged;
#   E2 the rollout benchmark on both workloads (rollout_throughput.py --workload pareto lognormal: the heavy-tail
#      Pareto and the APRIL paper's log-normal), sync / APRIL / pool against the full-occupancy limit, with the
#      simulator calibrated in the same run (its host terms included) and its error per mode;
# part train (Ray's wheel joined from both runs' parts and installed first: benchmarks/wheel_parts.py):
#   T1 the main job: train.py --colocate --offload --train-backend megatron --bf16 --partial-rollout, the embedded
#      engine on CUDA, the 0.5B preset, 8 steps on log-normal budgets (main_job_task.py); per step the time split,
#      the CUDA IPC weight push and the memory handed back each way (tools/step_split.py), then the ledger audit of
#      its checkpoint (tools/audit_ledger.py);
#   T2 train_async.py --rollout-mode stream, disaggregated on the same GPU: a Ray node without GPU resources (both
#      actors see the device and stay resident), weights by disk (NCCL pairs no two ranks on one GPU), 4 steps;
# then a summary, and acceptance_PART.json in $OUT. Every stage has its own time cap; one that fails or runs out of time
# is reported and the next one runs.
#
# Wheels (the GPU box reaches no registry; benchmarks/README.md, "On a GPU", says how to make them): complete cp312
# wheels in .whl/ and .whl2/ (GPU_MAIN_JOB_WHEELS), a wheel split in parts joined once all its parts are here; all
# installed into $WORK/site with --no-deps. $WORK (default runs/gpu_main_job_work, ignored by git, so a warm box keeps
# it from run 1 to run 2) also holds the models; logs and JSON go to $OUT (default /tmp/gpu_main_job).
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
PART=all
DRY=0
while (($#)); do
  case "$1" in
    --part) PART=${2:-}; shift ;;
    --cpu-dry-run) DRY=1 ;;
    *) echo "usage: bash benchmarks/gpu_main_job.sh [--part engine|train] [--cpu-dry-run]" >&2; exit 2 ;;
  esac
  shift
done
[[ $PART == all || $PART == engine || $PART == train ]] || { echo "--part: engine or train, not '$PART'" >&2; exit 2; }
if [[ $PART == all ]]; then
  if ((!DRY)); then
    echo "on a GPU the job runs in two parts (Ray's wheel comes in two runs): --part engine, then --part train" >&2; exit 2
  fi
  bash "$SELF" --cpu-dry-run --part engine; rc=$?  # as on the GPU: two runs, Ray only in the second
  bash "$SELF" --cpu-dry-run --part train || rc=$?
  exit $rc
fi
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_main_job}
WORK=${GPU_MAIN_JOB_WORK:-runs/gpu_main_job_work}
read -r -a WHEEL_DIRS <<< "${GPU_MAIN_JOB_WHEELS:-.whl .whl2}"
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd); WORK=$(cd "$WORK" && pwd)
MODELS="$WORK/models"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
START=$SECONDS
stage() { echo; echo "=== [$((SECONDS - START))s] $*"; }
: > "$OUT/status_$PART.txt"
run_capped() {  # run_capped NAME SECONDS CMD...: its output to $OUT/NAME.log (and here), its exit code to status_PART.txt
  local name=$1 cap=$2; shift 2
  local t0=$SECONDS
  timeout -s INT -k 20 "$cap" "$@" > >(tee "$OUT/$name.log" | grep --line-buffered -v -E "Writing model shards|Loading weights") 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s (cap ${cap}s)" | tee -a "$OUT/status_$PART.txt"
  return $rc
}

# ---- settings: the GPU's, or tiny ones for the dry run ------------------------------------------------------------
if ((DRY)); then
  MODEL=quickstart; GRAPHS=static  # the graphs' padded static-buffer step, run eagerly (no CUDA here)
  STEP_ARGS=(--rows 1 4 --context 32 --new-tokens 230 --seconds 0.5 --warmup 0.1 --windows 2); STEP_CAP=120
  # each mode a few steps (every step is followed by a limit slice: --min-seconds 1 made ~20 short pareto steps
  # per mode), a 1 s warm-up; the calibration as long as before, within a budget with slack for a loaded box
  ROLLOUT_ARGS=(--model-preset quickstart --cap 64 --scale 2 --concurrencies 16 --c-star 16 --warmup-steps 32
                --warmup-seconds 1 --rounds 1 --min-rounds 1 --min-seconds 0.1 --min-steps 2 --limit-seconds 1
                --limit-min-seconds 0.3 --calibration-seconds 6 --report-seconds 5 --time-budget 70)
  ROLLOUT_CAP=260
  CAP=128; TASK_ARGS=(--model quickstart --rows 512 --median 48 --cap $CAP); STEPS=${STEPS:-3}; STREAM_STEPS=$STEPS
  JOB_ARGS=(--rollout-batch-size 4 --n-samples-per-prompt 4 --global-batch-size 16 --micro-batch-size 8)
  OVER_SAMPLING=8; JOB_CAP=300; STREAM_CAP=300
else
  MODEL=qwen3-0.5b; GRAPHS=auto
  STEP_ARGS=(--rows 1 8 64 128 --context 512 --seconds 1 --warmup 0.3 --windows 3); STEP_CAP=60
  ROLLOUT_ARGS=(--model-preset qwen3-0.5b --cap 128 --scale 4 --concurrencies 128 --c-star 128 --rounds 3
                --min-rounds 1 --min-seconds 3 --min-steps 1 --limit-seconds 2 --limit-min-seconds 0.5
                --calibration-new-tokens 32 --calibration-seconds 12 --report-seconds 8 --time-budget 80)
  ROLLOUT_CAP=200
  CAP=512; TASK_ARGS=(--model qwen3-0.5b --rows 4096 --median 192 --cap $CAP); STEPS=${STEPS:-8}; STREAM_STEPS=4
  JOB_ARGS=(--rollout-batch-size 8 --n-samples-per-prompt 8 --global-batch-size 64 --micro-batch-size 8)
  OVER_SAMPLING=16; JOB_CAP=210; STREAM_CAP=120  # H100 2026-11-27: T1 start-up 70 s, 8 steps 95 s, shut-down past 170
fi

# ---- wheels and imports -------------------------------------------------------------------------------------------
stage "preflight (part $PART$( ((DRY)) && echo ', CPU dry run'); output in $OUT, work in $WORK)"
PYPATH="$PWD"
WHEELS=()
for d in "${WHEEL_DIRS[@]}"; do compgen -G "$d/*.whl" > /dev/null && WHEELS+=("$d"/*.whl); done
JOIN=(); [[ $PART != engine ]] && ((!DRY)) && JOIN=(--require ray)  # part train cannot run without Ray
$PY benchmarks/wheel_parts.py join --dirs "${WHEEL_DIRS[@]}" --out "$WORK/joined" "${JOIN[@]}" || exit 3
compgen -G "$WORK/joined/*.whl" > /dev/null && WHEELS+=("$WORK/joined"/*.whl)
if ((${#WHEELS[@]})); then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "${WHEELS[@]}" || exit 3
  echo "installed ${#WHEELS[@]} wheel(s) into $WORK/site: $(printf '%s ' "${WHEELS[@]##*/}")"
  PYPATH="$WORK/site:$PYPATH"
fi
if ((DRY)); then  # what the GPU box lacks, made unimportable here (Ray too in part engine: it must not need it)
  MISSING="datasets wandb sglang"; [[ $PART == engine ]] && MISSING+=" ray"  # (--part all runs both in turn)
  rm -rf "$WORK/missing-$PART"
  for m in $MISSING; do
    mkdir -p "$WORK/missing-$PART/$m"
    echo "raise ImportError('$m is not installed on the GPU box (gpu_main_job --cpu-dry-run)')" > "$WORK/missing-$PART/$m/__init__.py"
  done
  PYPATH="$WORK/missing-$PART:$PYPATH"
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
NEED_CUDA=$((1 - DRY)) PART=$PART $PY - <<'EOF' || exit 3
import importlib, os, platform, sys
import torch, transformers

need = ["aiohttp", "orjson", "numpy", "psutil", "requests", "tqdm", "sglang_router.launch_router"]
if os.environ["PART"] != "engine":
    need += ["ray", "megatron.core"]
missing = []
for m in need:
    try:
        importlib.import_module(m)
    except ImportError as e:
        missing.append(f"{m} ({e})")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"GPU: {gpu}, CPUs: {os.cpu_count()}")
if missing:
    sys.exit(f"cannot import {missing}: bring their cp312 wheels (benchmarks/README.md, 'On a GPU')")
if os.environ["NEED_CUDA"] == "1" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible: use --cpu-dry-run")
EOF

# ---- part engine ------------------------------------------------------------------------------------------------
if [[ $PART != train ]]; then
  stage "E1. decode step, $MODEL: eager, then CUDA graphs ($GRAPHS)"
  for mode in off "$GRAPHS"; do
    run_capped "E1_step_$mode" "$STEP_CAP" $PY benchmarks/engine_step.py --model "$MODEL" "${STEP_ARGS[@]}" \
      --cuda-graph-mode "$mode" --model-cache "$MODELS" --json-out "$OUT/step_$mode.json"
  done
  stage "E2. rollout benchmark on both workloads, --simulate"
  run_capped E2_rollout "$ROLLOUT_CAP" $PY benchmarks/rollout_throughput.py --workload pareto lognormal --log-dir "$OUT/rollout" \
    --json-out "$OUT/rollout_workloads.json" "${ROLLOUT_ARGS[@]}" --model-cache "$MODELS" --no-stale-kv-modes \
    --probe-passes 1 --probe-seconds 1.5 --calibration quick --simulate
fi

# ---- part train -------------------------------------------------------------------------------------------------
if [[ $PART != engine ]]; then
  stage "T1. the main job: train.py colocated, $MODEL, $STEPS steps"
  TASK="$WORK/task"
  $PY benchmarks/main_job_task.py --out "$TASK" --model-cache "$MODELS" "${TASK_ARGS[@]}" 2>&1 \
    | grep -v "Writing model shards" | tail -n 1 | tee "$OUT/task.json"
  TASK_MODEL="$MODELS/$MODEL"
  COMMON=(--hf-checkpoint "$TASK_MODEL" --prompt-data "$TASK/train.jsonl" --input-key prompt --label-key label
          --apply-chat-template --rm-type subtract_chain --rollout-max-response-len
          "$CAP" --rollout-ignore-eos --rollout-temperature 1.0 --advantage-estimator grpo --use-tis
          --lr 1e-6 --train-backend megatron --bf16 --rollout-backend embedded --partial-rollout --no-use-wandb
          "${JOB_ARGS[@]}")  # (no wandb on the GPU box: metrics.jsonl only)
  JOB="$WORK/main_job"; rm -rf "$JOB"
  run_capped T1_main_job "$JOB_CAP" $PY train.py "${COMMON[@]}" --num-rollout "$STEPS" \
    --over-sampling-batch-size "$OVER_SAMPLING" \
    --colocate --offload --update-weight-mode tensor \
    --save "$JOB/ckpt" --save-interval "$STEPS" --run-dir "$JOB"
  $PY tools/step_split.py "$JOB" --json "$OUT/main_job_split.json" | tee "$OUT/main_job_split.txt"
  # the engine re-captures its decode graphs after every release (the KV pool and weights move): what that cost
  grep -h "cuda_graph (" "$JOB"/engine_logs/engine_*.log 2>/dev/null | tail -n 1 | tee "$OUT/main_job_graphs.txt"
  $PY tools/audit_ledger.py "$JOB/ckpt" 2>&1 | tee "$OUT/main_job_audit.txt"
  cp "$JOB/metrics.jsonl" "$OUT/main_job_metrics.jsonl" 2>/dev/null

  stage "T2. train_async.py --rollout-mode stream, disaggregated on the same device, $STREAM_STEPS steps"
  RAY_TMP=$(mktemp -d /tmp/gmj_ray.XXXX)  # short: Ray's socket paths must fit
  RAY_PORT=$($PY -c "from slime.backends.hf_engine.local_server import free_port; print(free_port())")
  # a node with no GPU resource: Ray leaves CUDA_VISIBLE_DEVICES alone, so trainer and engine both see the device
  RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 setsid $PY -m ray.scripts.scripts start --head --block --num-gpus 0 \
    --num-cpus 8 --port "$RAY_PORT" --node-ip-address 127.0.0.1 --include-dashboard false --temp-dir "$RAY_TMP" \
    > "$OUT/T2_ray_head.log" 2>&1 &
  RAY_PID=$!
  STREAM="$WORK/stream"; rm -rf "$STREAM"
  for _ in $(seq 60); do grep -q "will now block" "$OUT/T2_ray_head.log" 2>/dev/null && break; sleep 1; done
  run_capped T2_stream "$STREAM_CAP" env RAY_ADDRESS=127.0.0.1:$RAY_PORT RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 \
    $PY train_async.py "${COMMON[@]}" --num-rollout "$STREAM_STEPS" --rollout-mode stream --update-weight-mode disk \
    --save "$STREAM/ckpt" --save-interval "$STREAM_STEPS" --run-dir "$STREAM"
  kill "$RAY_PID" 2>/dev/null; wait "$RAY_PID" 2>/dev/null
  rm -rf "$RAY_TMP"
  $PY tools/step_split.py "$STREAM" --json "$OUT/stream_split.json" | tee "$OUT/stream_split.txt"
  $PY tools/audit_ledger.py "$STREAM/ckpt" 2>&1 | tee "$OUT/stream_audit.txt"
fi

# ---- summary ----------------------------------------------------------------------------------------------------
stage "summary"
$PY benchmarks/gpu_main_job_summary.py "$OUT" --part "$PART" --steps "$STEPS" --stream-steps "$STREAM_STEPS" \
  $( ((DRY)) && echo --cpu-dry-run)
rc=$?  # 1: a check failed (acceptance_PART.json says which)
echo "gpu_main_job (part $PART$( ((DRY)) && echo ', CPU dry run')) done in $((SECONDS - START))s; files in $OUT"
exit $rc
