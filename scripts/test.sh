#!/usr/bin/env bash
# README's test command: install (idempotent) and run the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline \
       RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
${PYTHON:-python3} -m pytest "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit $rc
