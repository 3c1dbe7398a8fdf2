#!/usr/bin/env bash
# Training at length on one GPU, in one command (~5 minutes on an H100 / H200; no Ray, no network).
#
#   bash benchmarks/gpu_train_check.sh          # on the GPU box (wheels in .whl/, results under $OUT)
#   bash benchmarks/gpu_train_check.sh --cpu    # dry run here: the same steps at toy sizes (imports, flags, typos)
#   bash benchmarks/gpu_train_check.sh --final  # ~95 s: the RL batch with the default kernels (--compile-ops auto:
#                                               # on) and the trainer tests on CUDA, see "--final" below
#   bash benchmarks/gpu_train_check.sh --final --cpu   # its dry run here
#
# Needs next to the checkout: .whl/ with megatron-core 0.16.1 and orjson (cp312 wheels; benchmarks/README.md, "On
# a GPU", says how to download them). Ray, SGLang, datasets and wandb are not there: stub packages that raise
# ImportError stand first on PYTHONPATH so that nothing reaches for them unnoticed (here as on the box).
#
# Steps, each under its own time cap inside a total budget (BUDGET_S, default 290 s), results under $OUT:
#   A. GPU tests: test_megatron_gpu.py, the CUDA offload test (trainer's own allocation, ~60M model), the CUDA
#      varlen-kernel test, test_one_rl_step_equals_fsdp, the gspo tests of test_trainer.py        -> tests_gpu.xml
#   B. the ~0.5B Qwen3 (hidden 1024, 16 layers, vocab 151,936, tied), Megatron bf16 TP=1, 8 samples of
#      256 + ~16k tokens, micro-batch 1: peak GPU memory (target <= 40 GB)                         -> bench_16k.json
#   C. the RL-shaped batch (64 samples, 256-token prompts, 768-2,048-token responses: ~100k tokens), bf16,
#      --use-dynamic-batch-size --max-tokens-per-gpu 16384: Megatron packed, FSDP packed, Megatron padded: time
#      per train(), tokens/s, MFU (target >= 25%), FSDP / Megatron (target <= 1.3x)               -> bench_rl.json
#      and Megatron packed with --compile-ops (does torch.compile of RMSNorm / SwiGLU pay?)       -> bench_rl_compile.json
#   D. the rest of the trainer tests on CUDA (test_train_at_length, test_megatron_trainer, test_trainer,
#      test_logprob_head; not the slow ones)                                                        -> tests_rest.xml
#   E. the same batch at --micro-batch-size 2 (the issue's measurement: 5.40 s), packed and padded -> bench_rl_mbs2.json
# --final (BUDGET_S 95; the wheels' install is skipped when $SITE already has them, e.g. SITE=/tmp/gpu_check_work/site
# after benchmarks/gpu_check.sh):
#   T. in the background, 5 pytest processes on the GPU, each cut at T_CAP (45 s): test_megatron_trainer.py |
#      test_trainer.py's Megatron half | test_train_at_length.py | test_offload.py (the CUDA offload test) +
#      test_logprob_head.py (the fused head on CUDA) | test_trainer.py's FSDP half + test_train_device.py (not the
#      slow ones) -> tests_final_{1..5}.xml
#   R. meanwhile the RL batch as in C, one process: Megatron packed, then FSDP packed (FINAL_PADDED=1: Megatron
#      padded too, on the same trainer), with the defaults (--compile-ops auto: on here); the fused head's log-probs
#      against the eager head's on 8 samples; the timed train() calls wait for T (its kernels would share the GPU)
#                                                                               -> bench_final.json
# The last lines printed are the summary (also $OUT/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=gpu FINAL=0
for a in "$@"; do
  case "$a" in
    --cpu) MODE=cpu ;;
    --final) FINAL=1 ;;
    *) echo "usage: bash benchmarks/gpu_train_check.sh [--final] [--cpu]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-/tmp/gpu_train_check}
BUDGET_S=${BUDGET_S:-$( ((FINAL)) && echo 95 || echo 290)}
mkdir -p "$OUT"
START=$SECONDS
PY=${PYTHON:-python3}

# --- carried wheels and stubs --------------------------------------------------------------------------------
SITE=${SITE:-/tmp/site_train_check}
if [[ -f "$SITE/megatron/core/__init__.py" ]]; then
  echo "wheels already installed in $SITE"
elif compgen -G ".whl/megatron_core-*.whl" > /dev/null; then  # the trainer needs megatron-core and orjson only
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/megatron_core-*.whl \
    $(compgen -G ".whl/orjson-*.whl") 2>&1 | tail -2
fi
STUBS=/tmp/gpu_train_check_stubs  # (nothing big under $OUT: it travels back)
for pkg in ray sglang sglang_router datasets wandb math_verify; do
  mkdir -p "$STUBS/$pkg"
  echo "raise ImportError('$pkg is not installed on this box (stub from benchmarks/gpu_train_check.sh)')" \
    > "$STUBS/$pkg/__init__.py"
done
export PYTHONPATH="$STUBS:$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
PYTHONWARNINGS=ignore $PY - <<'EOF' 2>/dev/null | tee "$OUT/env.txt"
import torch, transformers, megatron.core, orjson
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
print("transformers", transformers.__version__, "megatron-core", megatron.core.__version__)
EOF

left() { echo $(( BUDGET_S - (SECONDS - START) )); }
step() {  # step NAME CAP_S command...: run under min(CAP_S, time left), log to $OUT/NAME.log, record the status
  local name=$1 cap=$2; shift 2
  local t; t=$(left); (( t > cap )) && t=$cap
  if (( t < 10 )); then echo "$name: skipped (budget spent)" | tee -a "$OUT/status.txt"; return; fi
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc in $(( SECONDS - t0 )) s (cap $t s)" | tee -a "$OUT/status.txt"
}
: > "$OUT/status.txt"

if [[ $MODE == gpu ]]; then
  MODEL=qwen3-0.5b; BF16=--bf16
  L16=(--samples 8 --group-size 8 --prompt-len 256 --response-min 15872 --response-max 16128 --micro-batch-size 1)
  LRL=(--samples 64 --group-size 8 --prompt-len 256 --response-min 768 --response-max 2048 --max-tokens-per-gpu 16384)
  LRL2=(--samples 64 --group-size 8 --prompt-len 256 --response-min 768 --response-max 2048 --micro-batch-size 2)
  CAPS=(90 45 100 45 120 60)  # A B C C-compile D E: later steps get what the budget leaves
else
  MODEL=tiny; BF16=
  L16=(--samples 2 --group-size 2 --prompt-len 16 --response-min 200 --response-max 240 --micro-batch-size 1)
  LRL=(--samples 8 --group-size 4 --prompt-len 8 --response-min 16 --response-max 64 --max-tokens-per-gpu 160)
  LRL2=(--samples 8 --group-size 4 --prompt-len 8 --response-min 16 --response-max 64 --micro-batch-size 2)
  CAPS=(240 120 240 120 300 120)
  BUDGET_S=${BUDGET_S_CPU:-$( ((FINAL)) && echo 600 || echo 900)}
fi
BENCH=(benchmarks/train_throughput.py --model "$MODEL" $BF16 --in-process --root "${MODELS:-/tmp/gpu_train_check_models}")
PYTEST=($PY -m pytest -q -p no:cacheprovider -o addopts="" --timeout 600)

if ((FINAL)); then
  # T: the tests in 5 background processes (their kernels share the GPU with R's warm-up, not with its timing)
  rm -f "$OUT/.tests_done"
  # cut at T_CAP by SIGINT: pytest still writes its junit report (what ran, what passed) when interrupted
  T_CAP=${T_CAP:-$( [[ $MODE == gpu ]] && echo 45 || echo $(( BUDGET_S - (SECONDS - START) - 30 )) )}
  tests_final() {  # tests_final N paths...
    local n=$1; shift
    timeout -s INT -k 10 "$T_CAP" "${PYTEST[@]}" --junitxml="$OUT/tests_final_$n.xml" "$@" > "$OUT/T_tests_final_$n.log" 2>&1
    echo "T_tests_final_$n: rc=$? at $(( SECONDS - START )) s (cap $T_CAP s)" >> "$OUT/status.txt"
  }
  (
    tests_final 1 tests/test_megatron_trainer.py -m "not slow" &
    tests_final 2 tests/test_trainer.py -m "not slow" -k megatron &
    tests_final 3 tests/test_train_at_length.py -m "not slow" &
    tests_final 4 tests/test_offload.py tests/test_logprob_head.py &  # (the fused head's test too: slow on CPU only)
    tests_final 5 tests/test_trainer.py tests/test_train_device.py -m "not slow" -k "not megatron" &
    wait
    touch "$OUT/.tests_done"
  ) &
  T_PID=$!
  FINAL_CONFIGS=(megatron:packed fsdp:packed)  # padded: FINAL_PADDED=1 (~+12 s: its warm-up compiles its shapes)
  [[ "${FINAL_PADDED:-0}" == 1 ]] && FINAL_CONFIGS=(megatron:packed megatron:padded fsdp:packed)
  step R_bench_final $(( BUDGET_S - 5 )) $PY "${BENCH[@]}" "${LRL[@]}" --steps 2 --configs "${FINAL_CONFIGS[@]}" \
    --check-fused-head 8 --wait-for-file "$OUT/.tests_done" --wait-for-timeout $(( T_CAP + 15 )) --json "$OUT/bench_final.json"
  wait "$T_PID"
else
step A_tests_gpu "${CAPS[0]}" "${PYTEST[@]}" --junitxml="$OUT/tests_gpu.xml" \
  tests/test_megatron_gpu.py \
  "tests/test_offload.py::test_cuda_offload_frees_most_of_the_trainers_memory" \
  "tests/test_logprob_head.py::test_cuda_varlen_kernel_matches_per_sample_attention" \
  "tests/test_megatron_trainer.py::test_one_rl_step_equals_fsdp" \
  "tests/test_trainer.py::test_gspo_dual_clip_applies_through_the_trainer_loss" \
  "tests/test_trainer.py::test_gspo_tis_weights_each_tokens_gradient_by_its_own_weight" \
  "tests/test_trainer.py::test_gspo_with_dual_clip_trains_with_gradient_accumulation"
step B_bench_16k "${CAPS[1]}" $PY "${BENCH[@]}" --backends megatron --layouts packed "${L16[@]}" --steps 1 \
  --json "$OUT/bench_16k.json"
step C_bench_rl "${CAPS[2]}" $PY "${BENCH[@]}" --backends megatron fsdp --layouts packed padded "${LRL[@]}" \
  --steps 2 --json "$OUT/bench_rl.json" --configs megatron:packed fsdp:packed megatron:padded
step C_bench_rl_compile "${CAPS[3]}" $PY "${BENCH[@]}" --backends megatron --layouts packed "${LRL[@]}" --steps 2 \
  --json "$OUT/bench_rl_compile.json" --compile-ops
step D_tests_rest "${CAPS[4]}" "${PYTEST[@]}" --junitxml="$OUT/tests_rest.xml" -m "not slow" \
  tests/test_train_at_length.py tests/test_logprob_head.py tests/test_megatron_trainer.py tests/test_trainer.py
step E_bench_rl_mbs2 "${CAPS[5]}" $PY "${BENCH[@]}" --configs megatron:packed megatron:padded "${LRL2[@]}" --steps 1 \
  --json "$OUT/bench_rl_mbs2.json"
fi

$PY - "$OUT" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
print("==== gpu_train_check summary ====")
print(open(os.path.join(out, "env.txt")).read().strip())
print(open(os.path.join(out, "status.txt")).read().strip())
slowest = []
for name in ("tests_gpu", "tests_rest", *(f"tests_final_{i}" for i in range(1, 6))):
    path = os.path.join(out, name + ".xml")
    if not os.path.exists(path):
        print(f"{name}: no report"); continue
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    print(f"{name}: {n['tests']} tests, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
    for case in root.iter("testcase"):
        slowest.append((float(case.get("time") or 0), f"{case.get('classname')}::{case.get('name')}"))
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            msg = (bad.get("message") or "").splitlines()[0][:200] if bad.get("message") else ""
            print(f"  FAIL {case.get('classname')}::{case.get('name')}: {msg}")
if slowest:
    print("slowest tests: " + ", ".join(f"{n.split('.')[-1]} {t:.1f} s" for t, n in sorted(slowest)[::-1][:6]))
def rows(name):
    path = os.path.join(out, name + ".json")
    return json.load(open(path))["results"] if os.path.exists(path) else []
for name in ("bench_16k", "bench_rl", "bench_rl_compile", "bench_rl_mbs2", "bench_final"):
    for r in rows(name):
        if "error" in r:
            print(f"{name} {r['backend']} {r['layout']}: ERROR {r['error'].strip().splitlines()[-1][:200]}"); continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        gpu = f"{r['gpu_peak_gb']:.1f} GB" if r.get("gpu_peak_gb") is not None else "-"
        extra = f", compile-ops {'on' if r.get('compile_ops') else 'off'}" if "compile_ops" in r else ""
        if r.get("fused_head_max_diff") is not None:
            extra += f", fused vs eager head max |d logp| {r['fused_head_max_diff']:.2g}"
        if (r.get("waited_s") or 0) >= 0.5:
            extra += f", waited {r['waited_s']:.0f} s for the tests"
        print(f"{name} {r['backend']:<8} {r['layout']:<6} {r['tokens']} tok: {r['train_s']:.2f} s/train "
              f"(old lp {r['old_logprob_s']:.2f} s), {r['tokens_per_s']:.0f} tok/s, MFU {mfu}, peak {gpu}{extra}")
rl = {(r["backend"], r["layout"]): r for r in rows("bench_rl") + rows("bench_final") if "error" not in r}
if ("fsdp", "packed") in rl and ("megatron", "packed") in rl:
    print(f"FSDP / Megatron time (bf16, packed): {rl['fsdp', 'packed']['train_s'] / rl['megatron', 'packed']['train_s']:.2f}x"
          " (target <= 1.3)")
for b in ("megatron", "fsdp"):
    if (b, "packed") in rl and (b, "padded") in rl:
        print(f"{b} packed / padded time: {rl[b, 'packed']['train_s'] / rl[b, 'padded']['train_s']:.2f}x")
comp = [r for r in rows("bench_rl_compile") if "error" not in r]
if comp and ("megatron", "packed") in rl:
    print(f"megatron --compile-ops / plain time: {comp[0]['train_s'] / rl['megatron', 'packed']['train_s']:.2f}x")
EOF
echo "gpu_train_check: $(( SECONDS - START )) s; results in $OUT"
