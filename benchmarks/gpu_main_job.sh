#!/usr/bin/env bash
# Issue 42's GPU measurements in two runs made back to back on one warm box (the second finds what the first
# unpacked), prepared so that a lease is spent on measuring only: every stage runs here first, on CPU, with
# --cpu-dry-run (tests/test_gpu_main_job.py does that in CI).
#
#   bash benchmarks/gpu_main_job.sh --part 1     # GPU run 1 (~270 s): carries .whl/ (the site, the GGUF's first part)
#   bash benchmarks/gpu_main_job.sh --part 2     # GPU run 2 (~330 s): carries .whl2/ (the GGUF's rest)
#   bash benchmarks/gpu_main_job.sh --cpu-dry-run [--part 1|2]   # both parts (or one) here, tiny settings
#
# What travels: benchmarks/gpu_payload.py (build it with a registry at hand; `check` prints each run's bytes).
# Each part runs its stages in order of need (what the last lease could not measure first); a stage runs under its
# own time cap and only when the part's budget (BUDGET_S) still holds what it needs at least (else "skipped"), so a
# lease is never spent on a stage that cannot finish. GPU_MAIN_JOB_STAGES="E2_lognormal M2 ..." runs only those.
# part 1 (router, Ray, Megatron from the payload's site):
#   E2_lognormal  the rollout benchmark on the APRIL paper's log-normal workload: sync, APRIL and pool against the
#                 full-occupancy limit, after every mode's warm-up, the simulator calibrated in the same run; the
#                 engine runs decode rows and prefill chunks in separate forwards (every decode forward replays its
#                 CUDA graph; a graph's capture is no measured step's cost)
#   M2  Megatron's MFU at Qwen3-4B's layer (hidden 2560, as many of its 36 layers as fit the card), and its profile
#   E2_pareto     the same on the heavy-tail Pareto workload
#   M1  Megatron's MFU at the 0.5B preset, and its profile
# part 2 (the real model from the GGUF, whole once both runs' parts are here), in this order:
#   C  SmolLM2-135M-Instruct converted from the GGUF (tools/convert_smollm2.py)
#   S  train_async.py --rollout-mode stream on it, disaggregated on the one GPU, >= 8 steps, its final save, ledger
#      audit
#   R  APRIL, then sync, on it (train.py colocated, bf16): the real-model quick start's train.py command, on its task
#      (benchmarks/gpu_payload.py made the data); ~60 s of start-up each (Ray, engine, trainer) before its steps
#   W  the colocated weight push (CUDA IPC) at Qwen3-4B's size (36 layers, ~8 GB bf16; met on 2026-11-28)
#   then the real-model experiment's own entry point ($REAL_BENCH, when it exists) in the time left
# then a summary (summary_PART.txt) and acceptance_PART.json. Every stage's measurements are written before anything
# optional (the trainer's profile after its variants' JSON). $OUT gets three files per part (a run returns at most
# 8): the two above and logs_PART.tgz (every stage's log and JSON), refreshed after each stage so a run cut short
# still returns them. $WORK (default runs/gpu_main_job_work, ignored by git, kept from run 1 to run 2 on a warm box)
# holds the unpacked payload, the models and the logs.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$SELF")/.."
PART=all
DRY=0
while (($#)); do
  case "$1" in
    --part) PART=${2:-}; shift ;;
    --cpu-dry-run) DRY=1 ;;
    *) echo "usage: bash benchmarks/gpu_main_job.sh --part 1|2 [--cpu-dry-run]" >&2; exit 2 ;;
  esac
  shift
done
[[ $PART == all || $PART == 1 || $PART == 2 ]] || { echo "--part: 1 or 2, not '$PART'" >&2; exit 2; }
if [[ $PART == all ]]; then
  ((DRY)) || { echo "on a GPU the job runs in two runs: --part 1, then --part 2" >&2; exit 2; }
  bash "$SELF" --cpu-dry-run --part 1; rc=$?
  bash "$SELF" --cpu-dry-run --part 2 || rc=$?
  exit $rc
fi
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_main_job}
WORK=${GPU_MAIN_JOB_WORK:-runs/gpu_main_job_work}
read -r -a DIRS <<< "${GPU_MAIN_JOB_PAYLOAD:-.whl .whl2}"
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd); WORK=$(cd "$WORK" && pwd)
LOGS="$WORK/logs_$PART"; rm -rf "$LOGS"; mkdir -p "$LOGS"
MODELS="$WORK/models"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled
BUDGET_S=${BUDGET_S:-$( ((DRY)) && echo 900 || { [[ $PART == 1 ]] && echo 270 || echo 330; })}
read -r -a STAGES <<< "${GPU_MAIN_JOB_STAGES:-E2_lognormal M2 E2_pareto M1 C S R W}"
want() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }
START=$SECONDS
left() { echo $(( BUDGET_S - (SECONDS - START) )); }
stage() { echo; echo "=== [$((SECONDS - START))s] $*"; }
snapshot() { tar czf "$OUT/logs_$PART.tgz.tmp" -C "$LOGS" . 2>/dev/null && mv "$OUT/logs_$PART.tgz.tmp" "$OUT/logs_$PART.tgz"; }
: > "$LOGS/status.txt"
run_capped() {  # run_capped NAME CAP NEED CMD...: under min(CAP, the budget left), skipped when less than NEED
  local name=$1 cap=$2 need=$3; shift 3  # seconds are left; log in $LOGS/NAME.log, status line
  local t; t=$(left); ((t > cap)) && t=$cap
  if ((t < need)); then
    echo "$name: skipped (needs ~${need}s, $(left)s of the budget left)" | tee -a "$LOGS/status.txt"; return 124
  fi
  local t0=$SECONDS
  timeout -s INT -k 20 "$t" "$@" > >(tee "$LOGS/$name.log" | grep --line-buffered -v -E "Writing model shards|Loading weights") 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0))s (cap ${t}s)" | tee -a "$LOGS/status.txt"
  snapshot
  return $rc
}

# ---- settings: the GPU's, or tiny ones for the dry run ------------------------------------------------------------
GPU_STREAM_STEPS=8; GPU_REAL_STEPS=12  # the real model's runs on the GPU (their command lines: part 2)
if ((DRY)); then
  ROLLOUT_ARGS=(--model-preset quickstart --cap 64 --scale 2 --concurrencies 16 --c-star 16 --warmup-steps 16
                --warmup-seconds 0.5 --rounds 1 --min-rounds 1 --min-seconds 0.1 --min-steps 1 --limit-seconds 0.5
                --limit-min-seconds 0.2 --calibration-seconds 4 --report-seconds 3  # no --time-budget: load-proof
                --step-composition separate --cuda-graph-mode static)  # the GPU's composition, graphs' shapes unreplayed
  WORKLOADS=(${E2_WORKLOADS:-lognormal}); E2_CAP=200; E2_NEED=15  # (the paper-shaped one; the GPU runs both)
  M_ARGS=(--model small --samples 4 --group-size 2 --prompt-len 8 --response-min 16 --response-max 48 --steps 1)
  M1_ARGS=("${M_ARGS[@]}" --variants 64 128 --profile); M2_ARGS=("${M_ARGS[@]}" --layers auto --card-gb 0.95
                                                                     --variants 128); M1_CAP=150; M2_CAP=150
  W_ARGS=(--model small --rounds 1); W_CAP=150
  STREAM_STEPS=2; REAL_STEPS=1; S_CAP=200; R_CAP=200; MODES_R=()  # (the GPU's lines are checked too: part 2)
  M_NEED=15; S_NEED=15; R_NEED=15; W_NEED=15
else
  # per workload: engines ready ~18 s, one sync step, each partial mode and the limit warmed up for 512 engine steps
  # (~20-35 s), a calibration pass, one round (~25 s), a second pass; the --time-budget is what the cap leaves
  ROLLOUT_ARGS=(--model-preset qwen3-0.5b --cap 128 --scale 4 --concurrencies 128 --c-star 128 --rounds 2
                --min-rounds 1 --min-seconds 3 --min-steps 1 --limit-seconds 2 --limit-min-seconds 0.5
                --calibration-new-tokens 32 --calibration-seconds 12 --report-seconds 6)
  WORKLOADS=(lognormal pareto); E2_CAP=115; E2_NEED=90
  # M1 / M2: the variants that gave the best MFU on 2026-11-28 (H200), then the profile (the JSON is written first)
  M1_ARGS=(--model qwen3-0.5b --variants 16384 --steps 1 --profile)  # 64 x (256 + 768..2048) tokens
  # as many of the 36 layers as fit at 8,192 tokens per micro-batch (the estimate: H100 26, H200 36)
  M2_ARGS=(--model qwen3-4b-shape --layers auto --samples 32 --variants 8192 --steps 1 --profile)
  M1_CAP=60; M2_CAP=80; M_NEED=45
  W_ARGS=(--model qwen3-4b-shape --rounds 2); W_CAP=60; W_NEED=40
  # S: ~60 s start-up, 8 steps ~25 s, its final save and the shutdown; R: ~60 s start-up, 12 steps ~35 s
  STREAM_STEPS=$GPU_STREAM_STEPS; REAL_STEPS=$GPU_REAL_STEPS; S_CAP=125; R_CAP=110; MODES_R=()
  S_NEED=110; R_NEED=100
fi

# ---- the payload, and what the box lacks made unimportable in the dry run ---------------------------------------
stage "preflight (part $PART$( ((DRY)) && echo ', CPU dry run'); budget ${BUDGET_S}s; logs in $LOGS)"
REQUIRE=(--require site); [[ $PART == 2 ]] && ((!DRY)) && REQUIRE+=(--require gguf --require real_data)
run_capped payload 120 15 $PY benchmarks/gpu_payload.py unpack --dirs "${DIRS[@]}" --work "$WORK" \
  $( ((DRY)) || echo "${REQUIRE[@]}") || { ((DRY)) || exit 3; }
PYPATH="$WORK/site:$PWD"
if ((DRY)); then  # what the GPU box lacks, unimportable (the payload's cp312 site is unpacked, not used, here)
  PYPATH="$PWD"
  rm -rf "$WORK/missing"
  for m in datasets wandb sglang; do
    mkdir -p "$WORK/missing/$m"
    echo "raise ImportError('$m is not installed on the GPU box (gpu_main_job --cpu-dry-run)')" > "$WORK/missing/$m/__init__.py"
  done
  PYPATH="$WORK/missing:$PYPATH"
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"
NEED_CUDA=$((1 - DRY)) PYTHONWARNINGS=ignore $PY - <<'EOF' 2>&1 | tee "$LOGS/env.txt" || exit 3
import importlib, os, platform, sys
import torch, transformers

missing = []
for m in ["aiohttp", "orjson", "numpy", "psutil", "requests", "tqdm", "sglang_router.launch_router", "ray",
          "megatron.core"]:
    try:
        importlib.import_module(m)
    except ImportError as e:
        missing.append(f"{m} ({e})")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"GPU: {gpu}, CPUs: {os.cpu_count()}")
if missing:
    sys.exit(f"cannot import {missing}: the payload's site is not here (benchmarks/gpu_payload.py)")
if os.environ["NEED_CUDA"] == "1" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible: use --cpu-dry-run")
EOF

# ---- part 1 -------------------------------------------------------------------------------------------------------
if [[ $PART == 1 ]]; then
  e2() {  # e2 WORKLOAD: the rollout benchmark on one workload, its --time-budget what its cap leaves
    local t; t=$(left); ((t > E2_CAP)) && t=$E2_CAP
    stage "E2. rollout benchmark, $1 workload, separate prefill forwards, --simulate"
    run_capped "E2_$1" "$E2_CAP" "$E2_NEED" $PY benchmarks/rollout_throughput.py --workload "$1" \
      --json-out "$LOGS/rollout_$1.json" "${ROLLOUT_ARGS[@]}" $( ((DRY)) || echo --time-budget $((t - 15))) \
      --model-cache "$MODELS" --no-stale-kv-modes --probe-passes 1 --probe-seconds 1.5 --calibration quick --simulate
  }
  m() {  # m NAME CAP ARGS...: the trainer's MFU
    local name=$1 cap=$2; shift 2
    stage "$name. Megatron MFU: $*"
    run_capped "$name" "$cap" "$M_NEED" $PY benchmarks/trainer_mfu.py "$@" --root "$MODELS/train" --json "$LOGS/$name.json"
  }
  for st in E2_lognormal M2 E2_pareto M1; do
    want "$st" || continue
    case $st in
      E2_*) [[ " ${WORKLOADS[*]} " == *" ${st#E2_} "* ]] && e2 "${st#E2_}" ;;
      M1) m M1 "$M1_CAP" "${M1_ARGS[@]}" ;;
      M2) m M2 "$M2_CAP" "${M2_ARGS[@]}" ;;
    esac
  done
fi

# ---- part 2 -------------------------------------------------------------------------------------------------------
if [[ $PART == 2 ]]; then
  # the real-model quick start's train.py command (scripts/quickstart.sh --real-model: reasoning-gym chain_sum, 4
  # groups x 8 samples, <= 64 new tokens, greedy held-out eval), in bf16 and without its CPU-sized prefill step
  real_flags() {  # real_flags MODEL DATA-DIR "REWARD-FLAGS" EVAL-INTERVAL DTYPE-FLAGS...
    local model=$1 data=$2 rm=$3 every=$4; shift 4
    echo --hf-checkpoint "$model" --prompt-data "$data/train.jsonl" --input-key prompt --label-key label \
      --apply-chat-template --rollout-shuffle --rollout-seed 1 --seed 1 $rm --rollout-batch-size 4 \
      --n-samples-per-prompt 8 --rollout-max-response-len 64 --rollout-temperature 1.0 --advantage-estimator grpo \
      --calculate-per-token-loss --use-tis --lr 1e-5 --global-batch-size 32 --micro-batch-size 16 \
      --eval-prompt-data held_out "$data/eval.jsonl" --eval-interval "$every" --eval-temperature 0 \
      --eval-max-response-len 64 --train-backend fsdp --rollout-backend embedded --no-use-wandb "$@"
  }
  read -r -a RGPU <<< "$(real_flags "$MODELS/smollm2" "$WORK/real_data" "--custom-rm-path slime.tasks.final_number.reward" \
                         $((GPU_REAL_STEPS / 2)) --bf16 \
                         --sglang-dtype bfloat16)"
  APRIL=(--partial-rollout --over-sampling-batch-size 8 --max-staleness 4 --staleness-policy restart)
  COLOCATED=(--colocate --offload --update-weight-mode tensor)
  STREAM=(--rollout-mode stream --partial-rollout --max-staleness 4 --staleness-policy restart
          --update-weight-mode disk)
  if ((DRY)); then
    # the GPU's command lines checked as on an H100 (train.py --dry-run: every flag, the plan, nothing started) ...
    stage "C. (dry run) the GPU's real-model command lines, train.py / train_async.py --dry-run h100"
    run_capped C_gpu_lines 120 15 $PY - train ${RGPU[*]} ${APRIL[*]} --num-rollout $GPU_REAL_STEPS ${COLOCATED[*]} \
      --run-dir "$WORK/x" --dry-run h100 -- train ${RGPU[*]} --num-rollout $GPU_REAL_STEPS ${COLOCATED[*]} \
      --run-dir "$WORK/x" --dry-run h100 -- train_async ${RGPU[*]} --num-rollout $GPU_STREAM_STEPS ${STREAM[*]} \
      --run-dir "$WORK/x" --dry-run h100 <<'EOF'
import importlib, sys

lines, cur = [], []
for a in sys.argv[1:] + ["--"]:  # ENTRY ARGS... -- ENTRY ARGS... (one process: the imports once)
    if a == "--":
        lines.append(cur)
        cur = []
    else:
        cur.append(a)
sys.exit(max(importlib.import_module(entry).main(argv) for entry, *argv in lines))
EOF
    # ... and run here on the tiny model and task in place of SmolLM2 (whose conversion is tests/test_smollm2.py's)
    $PY benchmarks/main_job_task.py --out "$WORK/task" --model-cache "$MODELS" --model quickstart --rows 256 \
      --median 24 --cap 48 2>&1 | grep -v "Writing model shards" | tail -n 1 > "$LOGS/task.json"
    head -n 16 "$WORK/task/train.jsonl" > "$WORK/task/eval.jsonl"
    read -r -a RCOMMON <<< "$(real_flags "$MODELS/quickstart" "$WORK/task" "--rm-type subtract_chain" 2 --no-bf16)"
    MODES_R=(april)  # sync is APRIL's command without APRIL's flags: checked above
  else
    stage "C. SmolLM2-135M-Instruct from the GGUF"
    want C && run_capped C_convert 90 40 $PY tools/convert_smollm2.py --out "$MODELS/smollm2"
    RCOMMON=("${RGPU[@]}"); MODES_R=(april sync)
  fi

  stream() {  # S: in a Ray head of its own whose node has no GPU resource (Ray then leaves CUDA_VISIBLE_DEVICES
    # alone, so trainer and engine both see the device); the head is started only when the budget holds the stage
    stage "S. train_async.py --rollout-mode stream, disaggregated on the one device, $STREAM_STEPS steps"
    if (($(left) < S_NEED + 10)); then
      echo "S_stream: skipped (needs ~$((S_NEED + 10))s, $(left)s of the budget left)" | tee -a "$LOGS/status.txt"
      return
    fi
    local tmp port pid
    tmp=$(mktemp -d /tmp/gmj_ray.XXXX)  # short: Ray's socket paths must fit
    port=$($PY -c "from slime.backends.hf_engine.local_server import free_port; print(free_port())")
    RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 setsid $PY -m ray.scripts.scripts start --head --block --num-gpus 0 \
      --num-cpus 8 --port "$port" --node-ip-address 127.0.0.1 --include-dashboard false --temp-dir "$tmp" \
      > "$LOGS/S_ray_head.log" 2>&1 &
    pid=$!
    for _ in $(seq 60); do  # (a head that died says why in its log, and the run after it fails at once)
      grep -q "will now block" "$LOGS/S_ray_head.log" 2>/dev/null && break; kill -0 "$pid" 2>/dev/null || break; sleep 1
    done
    rm -rf "$WORK/stream"
    # its one save is the final one (after step STREAM_STEPS): the ledger audit reads it
    run_capped S_stream "$S_CAP" "$S_NEED" env RAY_ADDRESS=127.0.0.1:$port RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 \
      $PY train_async.py "${RCOMMON[@]}" --num-rollout "$STREAM_STEPS" "${STREAM[@]}" --save "$WORK/stream/ckpt" \
      --save-interval "$STREAM_STEPS" --run-dir "$WORK/stream"
    # the head's own shutdown waits ~30 s for the GCS that the same signal stopped (drain_node's timeout): a few
    # seconds' grace, then the group is killed (nothing of the run is in it: the save and the metrics are on disk)
    kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null
    for _ in 1 2 3 4 5; do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- -"$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    rm -rf "$tmp"
    $PY tools/audit_ledger.py "$WORK/stream/ckpt" > "$LOGS/S_audit.txt" 2>&1
    cp "$WORK/stream/metrics.jsonl" "$LOGS/S_metrics.jsonl" 2>/dev/null
  }
  real() {  # R: train.py colocated, each mode in its own run (APRIL first: stream mode's rate is compared with it)
    local mode flags
    stage "R. the real model: ${MODES_R[*]}, train.py colocated, $REAL_STEPS steps each"
    for mode in "${MODES_R[@]}"; do
      flags=(); [[ $mode == april ]] && flags=("${APRIL[@]}")
      rm -rf "$WORK/real_$mode"
      run_capped "R_$mode" "$R_CAP" "$R_NEED" $PY train.py "${RCOMMON[@]}" "${flags[@]}" --num-rollout "$REAL_STEPS" \
        "${COLOCATED[@]}" --run-dir "$WORK/real_$mode"
      cp "$WORK/real_$mode/metrics.jsonl" "$LOGS/R_${mode}_metrics.jsonl" 2>/dev/null
    done
  }
  for st in S R W; do
    want "$st" || continue
    case $st in
      S) stream ;;
      R) real ;;
      W) stage "W. the colocated weight push at Qwen3-4B's size"
         run_capped W_push "$W_CAP" "$W_NEED" $PY benchmarks/weight_push.py "${W_ARGS[@]}" --root "$MODELS/train" \
           --json "$LOGS/weight_push.json" ;;
    esac
  done

  # the real-model experiment's own entry point, once it exists, in the time left (its CPU run is its own tests'): its
  # quick start's model and data are put where it looks (WORK), made already (the box lacks reasoning-gym)
  REAL_BENCH=${REAL_BENCH:-benchmarks/real_model.py}
  if [[ -f $REAL_BENCH ]] && ((!DRY)); then
    stage "R'. $REAL_BENCH on the GPU"
    mkdir -p "$WORK/real_work"; ln -sfn "$MODELS/smollm2" "$WORK/real_work/model"
    cp "$WORK/real_data/"*.jsonl "$WORK/real_work/"
    run_capped R_bench "$(left)" 120 env SLIME_SKIP_INSTALL=1 $PY "$REAL_BENCH" --steps "$REAL_STEPS" --sglang-steps 0 \
      --no-calibrate --work "$WORK/real_work" --out "$LOGS/real_bench" -- --bf16 --sglang-dtype bfloat16
  fi
fi

# ---- summary ----------------------------------------------------------------------------------------------------
stage "summary"
$PY benchmarks/gpu_main_job_summary.py "$LOGS" --part "$PART" --stream-steps "${STREAM_STEPS:-0}" \
  --real-steps "${REAL_STEPS:-0}" --real-modes ${MODES_R[@]+"${MODES_R[@]}"} $( ((DRY)) && echo --cpu-dry-run) 2>&1 \
  | tee "$LOGS/summary.txt"
rc=${PIPESTATUS[0]}  # 1: a check failed (acceptance_PART.json says which)
cp "$LOGS/summary.txt" "$OUT/summary_$PART.txt"; cp "$LOGS/acceptance.json" "$OUT/acceptance_$PART.json" 2>/dev/null
snapshot
echo "gpu_main_job (part $PART$( ((DRY)) && echo ', CPU dry run')) done in $((SECONDS - START))s; files in $OUT"
exit $rc
