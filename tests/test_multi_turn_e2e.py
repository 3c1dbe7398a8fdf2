"""Multi-turn tool use end to end (--agent-env)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from slime.tasks import subtract_tool as task
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer
from tests.test_train_e2e import _latest, _wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 4
STEPS = 5

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("multi_turn_e2e")
    task.write_dataset(str(d / "train.jsonl"), 200, seed=1, cap=16)
    task.write_dataset(str(d / "eval.jsonl"), 8, seed=2, cap=16)
    build_tiny_qwen3(str(d / "model"), build_tokenizer(task.VOCAB),
                     TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=256),
                     seed=5)
    return d


def _cmd(d, out, *extra, entry="train.py"):
    return [sys.executable, os.path.join(REPO, entry),
            "--hf-checkpoint", str(d / "model"), "--prompt-data", str(d / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--custom-rm-path", "slime.tasks.subtract_tool.reward",
            "--agent-env", "tests.tool_plugins.FLAKY_ENV", "--tool-timeout", "1", "--tool-workers", "2",
            "--max-turns", "8", "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "1",
            "--rollout-max-response-len", "48", "--num-rollout", str(STEPS), "--partial-rollout",
            *(() if "--rollout-mode" in extra else ("--over-sampling-batch-size", str(2 * BATCH))),
            "--lr", "1e-4", "--use-tis",
            "--eval-prompt-data", "tiny", str(d / "eval.jsonl"), "--eval-interval", "2",
            "--run-dir", str(out / "run"), "--save", str(out / "ckpt"), "--save-interval", "1",
            "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.json"), *extra]


def _parked_trajectories(ckpt) -> list[dict]:
    buf = json.loads((ckpt / "buffer" / "buffer.json").read_text())
    return [s for g in buf["parked"] for s in g if s["response_length"] > 0]


def test_kill_dash_nine_mid_trajectory_then_load_trains_every_group_once_and_tool_failures_drop(workdir, tmp_path):
    out = tmp_path
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log1 = open(out / "first.log", "w")
    proc = subprocess.Popen(_cmd(workdir, out), cwd=REPO, env=env, stdout=log1, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _latest(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"train.py ended before it could be killed:\n{(out / 'first.log').read_text()[-3000:]}"
    placement = json.loads((out / "run" / "placement.json").read_text())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = _latest(out)
    assert 1 <= killed_at < STEPS - 1
    assert _wait_gone([e["server_pid"] for e in placement["engines"]]) == []
    # the checkpoint it resumes from holds trajectories parked mid-way (their turns and calls recorded)
    parked = _parked_trajectories(out / "ckpt" / f"iter_{killed_at:07d}")
    assert parked and all(s["metadata"]["agent"]["turns"] for s in parked)

    done = subprocess.run(_cmd(workdir, out, "--load", str(out / "ckpt")), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _latest(out) == STEPS - 1

    final = out / "ckpt" / f"iter_{STEPS - 1:07d}"
    buf = json.loads((final / "buffer" / "buffer.json").read_text())
    ledger, reasons = buf["ledger"]["state"], buf["ledger"]["reason"]
    driver = json.loads((final / "driver_state.json").read_text())
    # every group the data source issued has one state, no gap; none trained twice
    assert sorted(int(k) for k in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    trained_in_ledger = sorted(int(k) for k, v in ledger.items() if v == "trained")
    trained = []
    for rid in range(STEPS):
        groups = json.load(open(out / "rollouts" / f"rollout_{rid}.json"))["groups"]
        for g in groups:
            assert len({s["group_index"] for s in g}) == 1
            for s in g:  # observation tokens never in the loss
                rec = s["metadata"]["agent"]
                for t in rec["turns"]:
                    assert set(s["loss_mask"][t["start"]:t["end"]]) <= ({1} if t["kind"] == "model" else {0})
            trained.append(g[0]["group_index"])
    assert len(trained) == len(set(trained)) and sorted(trained) == trained_in_ledger
    # the tool's failures: named per group in the ledger, and the run went on
    tool_drops = {int(k): r for k, r in reasons.items() if r.startswith("tool: calculator: ")}
    assert any("raised ValueError: cannot subtract" in r for r in tool_drops.values()), reasons
    assert all(ledger[str(k)] == "dropped" for k in tool_drops)
    rows = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    assert sum(r.get("rollout/groups_dropped/tool", 0) for r in rows) > 0
    assert any(r.get("rollout/tool/calls_per_sample_mean", 0) > 0 for r in rows)
    assert any("eval/tiny/tool/call_rate" in r for r in rows)
    assert any(r.get("rollout/tool/pending_calls", 0) == 0 and "rollout/tool/call_rate" in r for r in rows)


def test_train_async_stream_mode_runs_multi_turn(workdir, tmp_path):
    cmd = _cmd(workdir, tmp_path, "--rollout-mode", "stream", "--rollout-pool-size", "8", "--num-rollout", "3",
               "--save-interval", "3", entry="train_async.py")
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 0 and "rollout/tool/call_rate" in r]
    assert len({r["step"] for r in steps}) == 3
    assert sum(r["rollout/tool/calls_per_sample_mean"] for r in steps) > 0
    for rid in range(3):
        for g in json.load(open(tmp_path / "rollouts" / f"rollout_{rid}.json"))["groups"]:
            for s in g:
                assert s["metadata"]["agent"]["turns"] and len(s["weight_versions"]) == s["response_length"]
