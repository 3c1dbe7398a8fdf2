"""SGLang's own server (`sglang.launch_server`, SGLang 0.5.23 on CPU) for the `real_sglang` tests.

Engines start through our EngineGroup (`--rollout-backend sglang`) from tools/sglang_cpu_env.py's venv, which
`sglang_python()` waits for or installs (`SLIME_SKIP_REAL_SGLANG=1` skips these tests). A start costs 75-100 s
here: share one group per module (conftest.py's `real_sglang_engines`) and keep `max_new_tokens` small.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import threading
import time

import pytest
import requests

import pause_reference

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


# ---- the embedded engine judged by the real one (test_real_sglang.py) ---------------------------------------
def shape(value):
    """A reply's schema: dict keys (recursively), list element shapes, JSON types; numbers are one type."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    return "number"


# SGLang answers these (0.5.23's tokenizer manager and server); the embedded engine the same, or differently for
# a reason docs/sglang-compat.md gives. Values that differ by nature (ids, timings) are compared by shape only.
def compare(real: dict, emb: dict, what: str, same_tokens: bool = True) -> None:
    real, emb = copy.deepcopy(real), copy.deepcopy(emb)
    for meta in (real["meta_info"], emb["meta_info"]):
        # cache hits differ by design (docs/sglang-compat.md: the embedded prefix cache keeps aborted requests
        # only): `cached_tokens_details` is null with no hit, {"device", "host"} counts with one, on both
        details = meta.pop("cached_tokens_details")
        assert (details is None) == (meta["cached_tokens"] == 0), (what, meta)
        assert details is None or details == {"device": meta["cached_tokens"], "host": 0}, (what, details)
    assert shape(emb) == shape(real), f"{what}: reply schemas differ\nSGLang:   {shape(real)}\nembedded: {shape(emb)}"
    if same_tokens:
        assert emb["output_ids"] == real["output_ids"], what
        assert emb["text"] == real["text"], what
        assert emb["meta_info"]["finish_reason"] == real["meta_info"]["finish_reason"], what
        for a, b in zip(real["meta_info"].get("output_token_logprobs", []), emb["meta_info"].get("output_token_logprobs", [])):
            assert a[1:] == b[1:] and abs(a[0] - b[0]) < 1e-4, (what, a, b)


def abort_mid_way(url: str, rid: str, prompt: list[int]) -> dict:
    """A long request aborted by rid once the engine runs it (its load says so): the partial reply."""
    box = {}
    body = {"input_ids": prompt, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}}
    thread = threading.Thread(target=lambda: box.update(out=pause_reference.generate(url, body)))
    thread.start()
    while "out" not in box:
        load = requests.get(url + "/v1/loads?include=core", timeout=30).json()["loads"][0]
        if load["num_running_reqs"]:
            requests.post(url + "/abort_request", json={"rid": rid}, timeout=30)
            break
    thread.join(120)
    return box["out"]
