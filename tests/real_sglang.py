"""SGLang's own server (`sglang.launch_server`, SGLang 0.5.23 on CPU) for the `real_sglang` tests.

Engines are started by our own EngineGroup (`--rollout-backend sglang --sglang-python <the CPU venv>`), the code
a run uses: the launcher adds the CPU flags and import stand-ins, the real sglang-router fronts them. The venv is
`tools/sglang_cpu_env.py`'s: scripts/test.sh starts its install in the background, and `sglang_python()` waits
for it (one file lock) or installs it itself; `SLIME_SKIP_REAL_SGLANG=1` skips these tests, nothing else does.

conftest.py's `real_sglang_engines` fixture wraps `start_engines` (one group per module, shut down after it).
A server start costs 75-100 s on a loaded 2-core box: share a group across a module's tests, keep
`max_new_tokens` small, and wait for events, never for times.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import pytest

from slime.utils.sglang_versions import SGLANG_PINNED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COSTS = os.path.join(REPO, "runs", "test-costs", "real_sglang.jsonl")  # scripts/test.sh prints it at the end


def record_cost(what: str, seconds: float, **info) -> None:
    """One line of the real-SGLang group's cost (scripts/test.sh prints them after the suite)."""
    os.makedirs(os.path.dirname(COSTS), exist_ok=True)
    with open(COSTS, "a") as f:
        f.write(json.dumps({"what": what, "seconds": round(seconds, 1), "pid": os.getpid(), **info}) + "\n")


def sglang_python(version: str = SGLANG_PINNED) -> str:
    """The CPU venv's interpreter for SGLang `version`, installed (waiting for a concurrent install) unless
    SLIME_SKIP_REAL_SGLANG=1."""
    if os.environ.get("SLIME_SKIP_REAL_SGLANG") == "1":
        pytest.skip("SLIME_SKIP_REAL_SGLANG=1: real SGLang tests skipped")
    return _installed_venv(version)


@functools.lru_cache(maxsize=None)
def _installed_venv(version: str) -> str:
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import sglang_cpu_env
    finally:
        sys.path.pop(0)
    t0 = time.monotonic()
    python = sglang_cpu_env.install(version)
    record_cost(f"SGLang {version} venv ready (waited for or installed)", time.monotonic() - t0)
    return python


def engine_args(model_dir: str, prompt_data: str, run_dir: str, *flags: str, engines: int = 1,
                entry: str = "train.py", version: str = SGLANG_PINNED):
    """Parsed flags (of `entry`) for `engines` real SGLang engines serving `model_dir` (`flags` add or replace)."""
    from slime.arguments import parse_args

    return parse_args(["--hf-checkpoint", model_dir, "--prompt-data", prompt_data, "--label-key", "label",
                       "--rm-type", "subtract_chain", "--num-rollout", "4", "--rollout-batch-size", "2",
                       "--rollout-backend", "sglang", "--sglang-python", sglang_python(version),
                       "--rollout-num-gpus", str(engines), "--run-dir", run_dir, *flags], entry=entry)


def start_engines(args, log_dir: str):
    """An EngineGroup of `args.num_engines` real SGLang engines behind the real sglang-router, started."""
    from slime.backends.sglang_utils.engine_group import EngineGroup

    t0 = time.monotonic()
    group = EngineGroup(args, log_dir=log_dir).start()
    record_cost("engines started", time.monotonic() - t0, engines=args.num_engines)
    return group


def cmdline(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return [a.decode() for a in f.read().split(b"\0") if a]
