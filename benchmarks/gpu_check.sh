#!/usr/bin/env bash
# APRIL measured on one GPU, in one command, with nothing from the network.
#
#   bash benchmarks/gpu_check.sh              # ~8 min: every check, 2-3 benchmark rounds
#   bash benchmarks/gpu_check.sh --quick      # ~4.5 min: shorter windows, one or two rounds, quick calibration
#   bash benchmarks/gpu_check.sh --rollout-only # ~2.5 min (GPU_CHECK_BUDGET, default 145 s, wheels' install included):
#                                               # stage 1 without the memory check, stage 2 within what is left, the
#                                               # summary; every part bounded by its own time, with a message
#   bash benchmarks/gpu_check.sh --cpu-dry-run  # the same stages on a CPU box with tiny settings and Ray, datasets,
#                                               # wandb and sglang made unimportable: checks the script, not speeds
#                                               # (with --rollout-only: that mode's stages)
#
# Needs: python3 with torch (CUDA) and transformers, aiohttp, numpy, psutil, and sglang-router + orjson, which may be
# carried as cp312 manylinux wheels in .whl/ (installed into $GPU_CHECK_WORK/site, never from the network). No Ray.
# Stages (each prints as it goes; logs and JSON land in $OUT, default /tmp/gpu_check):
#   1. the embedded engine's decode step at 1, 8, 64 and 128 rows, random Qwen3 ~0.5B (Qwen3-0.6B's width and
#      vocabulary, 16 layers) in bfloat16 on the GPU; then /release_memory_occupation's memory given back;
#   2. benchmarks/rollout_throughput.py on that model: sync / APRIL / pool vs the full-occupancy limit on the
#      long-tailed workload, with the simulator calibrated in the same run and its prediction of each mode;
#   3. the GPU tests (tests/test_hf_engine_cuda.py);
#   4. the quick start's model served on the GPU, its decode step at 1-128 rows;
#   5. tools/simulate_rollout.py calibrate --url against a running GPU engine (when time is left);
#   then one summary with the issue's acceptance checks.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=full
DRY=0
for arg in "$@"; do
  case "$arg" in
    --quick) MODE=quick ;;
    --rollout-only) MODE=rollout ;;
    --cpu-dry-run) DRY=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--quick | --rollout-only] [--cpu-dry-run]" >&2; exit 2 ;;
  esac
done
if [[ $DRY == 1 && $MODE != rollout ]]; then MODE=cpu; fi
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}  # logs and JSON (small: a device tool's $OUT comes back whole)
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}  # models (~1 GB) and the carried wheels' install, kept out of $OUT
mkdir -p "$OUT" "$WORK"
CACHE="$WORK/models"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
PYPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  WHEELS=(.whl/*.whl)
  if [[ $MODE == rollout ]]; then  # the router and what its launcher imports: not the trainer's megatron-core
    WHEELS=($(printf '%s\n' "${WHEELS[@]}" | grep -v -i megatron))
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$WORK/site" "${WHEELS[@]}" || exit 3
  PYPATH="$WORK/site:$PYPATH"
fi
if [[ $MODE == cpu || $DRY == 1 ]]; then  # what the GPU box lacks, made unimportable here
  for m in ray datasets wandb sglang; do
    mkdir -p "$WORK/missing/$m"
    echo "raise ImportError('$m is not installed on the GPU box (gpu_check --cpu-dry-run)')" > "$WORK/missing/$m/__init__.py"
  done
  PYPATH="$WORK/missing:$PYPATH"
fi
export PYTHONPATH="$PYPATH${PYTHONPATH:+:$PYTHONPATH}"

# ---- settings per mode ------------------------------------------------------------------------------------
BIG=qwen3-0.5b
ROWS=(1 8 64 128)
STEP_EXTRA=(--memory-check)
case $MODE in
  full)  BUDGET=560; STEP_S=2;   STAGE1=180; BENCH_ROUNDS=(--rounds 3 --min-rounds 2 --min-seconds 5 --min-steps 1 --calibration full) ;;
  quick) BUDGET=270; STEP_S=1;   STAGE1=100; BENCH_ROUNDS=(--rounds 2 --min-rounds 1 --min-seconds 3 --min-steps 1 --calibration quick) ;;
  cpu)   BUDGET=900; STEP_S=0.5; STAGE1=240; ROWS=(1 4); BENCH_ROUNDS=(--rounds 1 --min-rounds 1 --min-seconds 1 --min-steps 1 --calibration quick) ;;
  # one stage-1 pass (no memory check: the last GPU run checked it), then the rollout benchmark in what is left
  rollout) BUDGET=${GPU_CHECK_BUDGET:-145}; STEP_S=0.6; STAGE1=40; STEP_EXTRA=(--warmup 0.3 --windows 3)
           BENCH_ROUNDS=(--rounds 3 --min-rounds 1 --min-seconds 3 --min-steps 1 --calibration quick
                         --calibration-new-tokens 32 --calibration-seconds 12 --report-seconds 8)
           if [[ $DRY == 1 ]]; then ROWS=(1 4); STAGE1=90; BUDGET=${GPU_CHECK_BUDGET:-240}; fi ;;
esac
left() { echo $((BUDGET - SECONDS)); }
stage() { echo; echo "=== [$((SECONDS))s] $*"; }

stage "preflight ($MODE mode$([[ $DRY == 1 ]] && echo ', CPU dry run'), budget ${BUDGET}s; output in $OUT)"
NEED_CUDA=$([[ $MODE == cpu || $DRY == 1 ]] && echo 0 || echo 1) $PY - <<'EOF' || exit 3
import importlib, os, platform, sys
import torch, transformers

need_cuda = os.environ["NEED_CUDA"] == "1"

def importable(m):
    try:
        importlib.import_module(m)
        return True
    except ImportError:
        return False

# the router's own imports included (sglang_router.launch_router: fastapi, uvicorn, pydantic, setproctitle)
need = ["aiohttp", "orjson", "numpy", "psutil", "requests", "tqdm", "sglang_router.launch_router"]
missing = [m for m in need if not importable(m)]
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, GPU: {gpu}")
print("not needed here: " + ", ".join(f"{m} {'present' if importable(m) else 'absent'}" for m in ("ray", "datasets", "wandb", "sglang")))
if missing:
    sys.exit(f"cannot import {missing}: bring their cp312 wheels in .whl/ (benchmarks/README.md, 'On a GPU')")
if need_cuda and not torch.cuda.is_available():
    sys.exit("no CUDA device visible: use --cpu-dry-run")
EOF

# ---- 1. decode step of the ~0.5B model ------------------------------------------------------------------------
STEP_MODEL=$([[ $MODE == rollout && $DRY == 1 ]] && echo quickstart || echo $BIG)  # a dry run checks the script
stage "1. engine decode step, $STEP_MODEL, rows ${ROWS[*]}"
if [[ $MODE == cpu ]]; then STEP_EXTRA+=(--context 32 --new-tokens 48)
elif [[ $DRY == 1 ]]; then STEP_EXTRA+=(--context 32 --new-tokens 230)  # the quick start's model: ~4 ms a step here
else STEP_EXTRA+=(--context 512); fi
timeout -s INT -k 20 $STAGE1 $PY benchmarks/engine_step.py --model $STEP_MODEL --rows "${ROWS[@]}" --seconds $STEP_S \
  "${STEP_EXTRA[@]}" --model-cache "$CACHE" --json-out "$OUT/step_$STEP_MODEL.json" 2>&1 | grep -v "Writing model shards" \
  | tee "$OUT/step_$STEP_MODEL.log"
echo "stage 1 exit ${PIPESTATUS[0]} after ${SECONDS}s"

# ---- 2. the rollout benchmark and the simulator ---------------------------------------------------------------
# The workload: budgets scale x q tokens, q a truncated Pareto (cap 128: median 3 x scale, max 128 x scale, 43x; cap 64:
# 21x). A sync step lasts about as many engine steps as the longest budget: a slower step (ms at 128 rows, from
# stage 1) gets a smaller scale. The benchmark bounds its own warm-up, calibration and rounds by --time-budget.
CAP=$([[ $MODE == rollout || $MODE == cpu ]] && echo 64 || echo 128)
SCALE="$($PY - "$OUT/step_$STEP_MODEL.json" "$MODE" "$DRY" "$CAP" <<'EOF'
import json, sys
mode, dry, cap = sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
try:
    step = json.load(open(sys.argv[1]))["step_ms"]
    ms = step.get("128", max(step.values()))
except (OSError, ValueError, KeyError):
    ms = 20.0
if mode == "cpu" or dry:
    print(2)
elif mode == "rollout":  # a sync step of ~8 s: the benchmark's steps run ~1.3x stage 1's (the HTTP side's share)
    print(max(3, min(8, int(8.0 / (cap * 1.3 * ms / 1000)))))
else:  # ~15 s at 8 x 128 x 15 ms
    print((8 if ms <= 22 else 4) if mode == "full" else (6 if ms <= 22 else 3))
EOF
)"
if [[ $MODE == cpu || $DRY == 1 ]]; then
  BENCH_MODEL=(--model-preset quickstart --cap 64 --concurrencies 16 --c-star 16 --warmup-steps 64)
else
  BENCH_MODEL=(--model-preset $BIG --cap $CAP --concurrencies 128 --c-star 128)
fi
case $MODE in full) RESERVE=150 ;; rollout) RESERVE=4 ;; *) RESERVE=65 ;; esac  # what comes after stage 2
BENCH_BUDGET=$(( $(left) - RESERVE ))
LIMIT_S=$([[ $MODE == rollout ]] && echo 2 || echo 3)
stage "2. rollout benchmark: sync / APRIL / pool vs the limit, --simulate (cap $CAP, scale $SCALE, --time-budget ${BENCH_BUDGET}s)"
timeout -s INT -k 15 $((BENCH_BUDGET + 20)) $PY benchmarks/rollout_throughput.py "${BENCH_MODEL[@]}" \
  --model-cache "$CACHE" --scale "$SCALE" --no-stale-kv-modes --probe-passes 1 \
  --probe-seconds 1.5 --limit-min-seconds 0.5 --limit-seconds $LIMIT_S "${BENCH_ROUNDS[@]}" --simulate \
  --time-budget $BENCH_BUDGET --json-out "$OUT/rollout.json" 2>&1 \
  | tee "$OUT/rollout.log" | grep --line-buffered -v -E '^\{|Writing model shards|rollout_throughput (sync|april|pool) step'
echo "rollout benchmark exit ${PIPESTATUS[0]} after ${SECONDS}s (its full output: $OUT/rollout.log)"

# ---- 3. GPU tests -------------------------------------------------------------------------------------------------
if [[ $MODE == rollout ]]; then
  stage "3-5. skipped (--rollout-only)"
elif (( $(left) > 35 )); then
  stage "3. tests/test_hf_engine_cuda.py"
  timeout -s INT -k 10 $(( $(left) - 15 )) $PY -m pytest -q -p no:cacheprovider tests/test_hf_engine_cuda.py 2>&1 | tail -n 15 \
    | tee "$OUT/pytest.log"
else
  stage "3. skipped: $(left)s left"
fi

# ---- 4. the quick start's model ---------------------------------------------------------------------------------
if [[ $MODE == rollout ]]; then
  :
elif (( $(left) > 25 )); then
  stage "4. engine decode step, quickstart model"
  timeout -s INT -k 10 $(( $(left) - 5 )) $PY benchmarks/engine_step.py --model quickstart --rows "${ROWS[@]}" --seconds 0.5 \
    --model-cache "$CACHE" --json-out "$OUT/step_quickstart.json" 2>&1 | grep -v "Writing model shards" | tail -n 8
else
  stage "4. skipped: $(left)s left"
fi

# ---- 5. the simulator's calibration against a running engine ----------------------------------------------------
CAL_MODEL=$([[ $MODE == cpu ]] && echo quickstart || echo $BIG)
if [[ $MODE == rollout ]]; then
  :
elif (( $(left) > 50 )); then
  stage "5. tools/simulate_rollout.py calibrate --url (engine on $CAL_MODEL)"
  PORT=$($PY -c "from slime.backends.hf_engine.local_server import free_port; print(free_port())")
  [[ -d "$CACHE/$CAL_MODEL" ]] || $PY -c "from slime.utils.tiny_model import build_preset, build_tokenizer; from slime.tasks.subtract_chain import VOCAB; build_preset('$CAL_MODEL', '$CACHE', build_tokenizer(VOCAB))"
  $PY -m slime.backends.hf_engine --model-path "$CACHE/$CAL_MODEL" --port "$PORT" > "$OUT/calibrate_engine.log" 2>&1 &
  ENGINE_PID=$!
  $PY - "$PORT" "$ENGINE_PID" <<'EOF'
import os, sys, time
import requests
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(600):
    try:
        if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            break
    except requests.RequestException:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("the engine exited: see calibrate_engine.log")
    time.sleep(0.5)
EOF
  timeout -s INT -k 10 $(( $(left) - 40 > 30 ? $(left) - 40 : 30 )) $PY tools/simulate_rollout.py calibrate --url "http://127.0.0.1:$PORT" \
    --vocab 16 --passes 1 --quick --curve 1,64 --out "$OUT/cost_$CAL_MODEL.json" 2>&1 | tail -n 4
  kill $ENGINE_PID 2>/dev/null; wait $ENGINE_PID 2>/dev/null
else
  stage "5. skipped: $(left)s left"
fi

# ---- summary ------------------------------------------------------------------------------------------------------
stage "summary"
$PY - "$OUT" "$BIG" "$MODE" <<'EOF'
import json, os, sys
out, big, mode = sys.argv[1], sys.argv[2], sys.argv[3]

def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

ok = {}
for name in (f"step_{big}.json", "step_quickstart.json"):
    s = load(name)
    if s is None and mode == "rollout":
        continue  # --rollout-only runs one of them
    if s is None:
        print(f"{name}: missing (the stage failed or was skipped)")
        continue
    rows = sorted(s["step_ms"], key=int)
    ratio = s["step_ms"][rows[-1]] / s["step_ms"][rows[0]]
    print(f"{s['model']} on {s['device']} ({s['device_name']}, {s['dtype']}): decode step ms " + ", ".join(
        f"{r} rows {s['step_ms'][r]:.2f} (issued {s['launch_ms'][r]:.2f})" for r in rows)
        + f"; {rows[-1]}/{rows[0]} rows = {ratio:.2f}x; served {s['served']}, deterministic {s['deterministic']}")
    ok[f"{s['model']}: step at {rows[-1]} rows <= 2x at {rows[0]}"] = ratio <= 2.0
    ok[f"{s['model']}: served"] = s["served"] and s["deterministic"]
    if s.get("memory") and "device_given_back" in s["memory"]:
        m = s["memory"]
        print(f"  memory saver: {m['device_given_back'] / 2**30:.2f} GiB given back to the device "
              f"(weights {m['weight_bytes'] / 2**30:.2f} + KV {m['kv_cache_bytes'] / 2**30:.2f} GiB); "
              f"tokens unchanged after resume {m['same_tokens_after_resume']}")
        ok["memory saver frees device memory"] = m["given_back_ok"] and m["same_tokens_after_resume"]
r = load("rollout.json")
if r is None:
    print("rollout.json: missing (see rollout.log)")
else:
    print(f"rollout ({r['engine']['device']}, C* {r['c_star']}, {r['rounds']} round(s)): limit {r['limit_tok_s']:.0f} tok/s; "
          + "; ".join(f"{m} {r[m + '_tok_s']:.0f} tok/s = {r[m + '_over_limit']:.3f}x the limit" for m in ("sync", "april", "pool"))
          + f"; APRIL {r['april_over_sync']:.2f}x sync")
    sim = r.get("simulated")
    if sim:
        print("simulator vs measured: " + ", ".join(
            f"{m} {sim[m]['sim_tok_s']:.0f} vs {sim[m]['measured_tok_s']:.0f} ({100 * sim[m]['error']:+.1f}%)"
            for m in ("sync", "april", "pool")))
    else:
        print("simulator: no prediction (see rollout.log)")
    ok.update({k: v for k, v in (r.get("gpu_acceptance") or {}).items() if isinstance(v, bool)})
    tb = r.get("time_budget") or {}
    print(f"rollout benchmark: {tb.get('elapsed_s')}s of its {tb.get('budget_s')}s budget at the report, "
          f"{tb.get('step_ms')} ms per decode step at C*, warm-up up to {tb.get('warmup_s')}s per mode")
print("acceptance: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in ok.items()))
json.dump(ok, open(os.path.join(out, "acceptance.json"), "w"), indent=1)
EOF
echo "gpu_check ($MODE) done in ${SECONDS}s; files in $OUT"
