#!/usr/bin/env bash
# Install the package and its dependencies into the current Python (idempotent).
# On CPU machines the CPU build of torch is installed first, so that resolving
# `torch` never pulls the multi-GB CUDA build. Set TORCH_SPEC to override
# (e.g. TORCH_SPEC="torch==2.13.0+cpu" with a PyTorch CPU index in PIP_EXTRA_INDEX_URL).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${SLIME_EXTRAS:-test}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[install] installing ${TORCH_SPEC:-torch==2.13.0} (CPU build where available)"
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi

stamp_dir=$("$PY" -c "import sys; print(sys.prefix)")
key=$( (cat setup.py; pwd; echo "$EXTRAS") | sha1sum | cut -c1-16)
stamp="$stamp_dir/.slime-april-install-$key"
# asked from / : from the checkout itself, `import slime` finds ./slime whether or not it is installed
here=$(cd / && "$PY" -c "import os, slime; print(os.path.dirname(os.path.dirname(os.path.abspath(slime.__file__))))" 2>/dev/null || true)
if [[ -f "$stamp" && "$here" == "$(pwd)" ]]; then
  echo "[install] already installed ($(pwd)); skipping"
  exit 0
fi
echo "[install] pip install -e .[$EXTRAS]"
"$PY" -m pip install -q -e ".[$EXTRAS]"
touch "$stamp" 2>/dev/null || true
