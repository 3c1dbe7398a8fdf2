"""train.py end to end on the embedded engine: a run, a kill -9 mid-run, and a resume from the checkpoint."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slime.tasks import subtract_chain as task
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 4
STEPS = 6

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_e2e")
    task.write_dataset(str(d / "train.jsonl"), 200, seed=1, cap=16)
    task.write_dataset(str(d / "eval.jsonl"), 8, seed=2, cap=16)
    build_tiny_qwen3(str(d / "model"), build_tokenizer(task.VOCAB),
                     TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=256))
    return d


def _cmd(d, *extra):
    return [sys.executable, os.path.join(REPO, "train.py"),
            "--hf-checkpoint", str(d / "model"), "--prompt-data", str(d / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--rm-type", "subtract_chain",
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "4", "--rollout-max-response-len", "48",
            "--num-rollout", str(STEPS), "--partial-rollout", "--over-sampling-batch-size", str(2 * BATCH),
            "--lr", "1e-4", "--use-tis", "--run-dir", str(d / "run"), "--save", str(d / "ckpt"), "--save-interval", "1",
            "--save-debug-rollout-data", str(d / "rollouts" / "rollout_{rollout_id}.json"), *extra]


def _latest(d):
    p = d / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(p.read_text()) if p.exists() else -1


def _wait_gone(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def test_kill_dash_nine_then_resume_loses_nothing_and_trains_nothing_twice(workdir):
    d = workdir
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log1 = open(d / "first.log", "w")
    proc = subprocess.Popen(_cmd(d), cwd=REPO, env=env, stdout=log1, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while _latest(d) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"train.py ended before it could be killed:\n{(d / 'first.log').read_text()[-3000:]}"
    engines = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = _latest(d)
    assert 1 <= killed_at < STEPS - 1
    # Engines and the router die with the driver (no orphans serving stale weights).
    engine_like = [p for p in engines if b"hf_engine" in open(f"/proc/{p}/cmdline", "rb").read() or b"sglang_router" in open(f"/proc/{p}/cmdline", "rb").read()] if engines else []
    assert _wait_gone(engine_like) == []

    done = subprocess.run(_cmd(d, "--load", str(d / "ckpt")), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"at rollout {killed_at + 1}" in done.stderr + done.stdout
    assert _latest(d) == STEPS - 1

    final = d / "ckpt" / f"iter_{STEPS - 1:07d}"
    ledger = json.loads((final / "buffer" / "buffer.json").read_text())["ledger"]["state"]
    driver = json.loads((final / "driver_state.json").read_text())
    # Every group the data source ever issued has exactly one state, with no gap in the ids.
    assert sorted(int(k) for k in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    trained_in_ledger = sorted(int(k) for k, v in ledger.items() if v == "trained")
    assert len(trained_in_ledger) == STEPS * BATCH
    assert driver["rollout"]["policy_version"] == STEPS

    # The groups trained in each step (as dumped by the surviving history): none twice, each the prompt row
    # that the data source's order says (no prompt repeated or skipped).
    trained = []
    for rid in range(STEPS):
        groups = json.load(open(d / "rollouts" / f"rollout_{rid}.json"))["groups"]
        assert len(groups) == BATCH
        for g in groups:
            assert len({s["group_index"] for s in g}) == 1 and len(g) == 4
            assert all(s["metadata"]["row"] == s["group_index"] for s in g)
            trained.append(g[0]["group_index"])
    assert sorted(trained) == trained_in_ledger

    rows = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    last = [r for r in rows if r["step"] == STEPS - 1][-1]
    for key in ("rollout/tokens_per_s", "rollout/off_policy_token_ratio", "reward/mean", "train/tis_ess",
                "weight_sync/weight_sync_time_s"):
        assert key in last
