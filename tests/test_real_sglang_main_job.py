"""README's main job on SGLang's own server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from real_sglang import REPO, cmdline, record_cost, sglang_python

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.timeout(1500)]
STEPS = 6


def _launch_servers(driver_pid: int) -> list[psutil.Process]:
    """The job's SGLang servers: descendants whose command line is `<python> -m sglang.launch_server ...`."""
    try:
        procs = psutil.Process(driver_pid).children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in procs:
        try:
            if p.cmdline()[1:3] == ["-m", "sglang.launch_server"]:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _steps_logged(run) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _wait(cond, what: str, proc, log, timeout: float = 900):
    """Until `cond()`; fails at once if the run exits first (`timeout` is a safety net, far above the event)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} yet:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def main_job(quickstart_task, tmp_path_factory):
    python = sglang_python()
    run = tmp_path_factory.mktemp("quickstart_sglang") / "run"
    log = run.parent / "quickstart.log"
    env = {**os.environ, "RUN": str(run), "STEPS": str(STEPS), "EVAL_INTERVAL": "1000", "SIMULATE": "0",
           "SLIME_SKIP_INSTALL": "1", "SLIME_SGLANG_PYTHON": python, "PYTHONUNBUFFERED": "1"}
    cmd = ["bash", os.path.join(REPO, "scripts", "quickstart.sh"), "--rollout-backend", "sglang",
           # 6 short steps: 4 groups of 2 out of 8 over-sampled, 32 tokens at most, one trainer batch per step
           "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "8",
           "--rollout-max-response-len", "32", "--global-batch-size", "8", "--micro-batch-size", "8",
           "--skip-eval-before-train", "--use-fault-tolerance", "--rollout-health-check-interval", "2",
           "--rollout-health-check-timeout", "10",
           "--save-debug-rollout-data", str(run.parent / "rollouts" / "rollout_{rollout_id}.json")]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    out = {"run": run, "log": log}
    try:
        _wait(lambda: 1 in _steps_logged(run), "step 1", proc, log)
        first = _launch_servers(proc.pid)
        out["first"] = [(p.pid, p.cmdline()) for p in first]
        for p in first:
            p.send_signal(signal.SIGKILL)
        _wait(lambda: [p.pid for p in _launch_servers(proc.pid)] not in ([], [p.pid for p in first]),
              "a restarted engine", proc, log)
        out["second"] = [(p.pid, cmdline(p.pid)) for p in _launch_servers(proc.pid)]
        proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    out["rc"] = proc.returncode
    out["text"] = log.read_text()
    record_cost("main job: quickstart.sh --rollout-backend sglang, 6 steps, one engine killed", time.monotonic() - t0)
    return out


def test_engines_are_sglang_launch_server_from_the_cpu_venv(main_job):
    """The engines are SGLang's server from the venv with our CPU flags, before and after the restart."""
    python = sglang_python()
    assert len(main_job["first"]) == 1 and len(main_job["second"]) == 1, main_job
    for _, argv in main_job["first"] + main_job["second"]:
        assert argv[:3] == [python, "-m", "sglang.launch_server"], argv
        assert argv[argv.index("--device") + 1] == "cpu" and "--disable-cuda-graph" in argv
        assert argv[argv.index("--model-path") + 1].endswith(os.path.join("runs", "tiny", "model-sft"))
    assert main_job["first"][0][0] != main_job["second"][0][0]


def test_main_job_survives_the_killed_engine_and_finishes(main_job):
    assert main_job["rc"] == 0, main_job["text"][-5000:]
    text, run = main_job["text"], main_job["run"]
    killed = main_job["first"][0][0]
    # named by the watchdog (the server's process state) and restarted; the run went on
    assert re.search(rf"restart 1/\d+: engine 0 \(http://127\.0\.0\.1:\d+\) (died \(pid {killed}|exited with code -9)", text), \
        [line for line in text.splitlines() if "restart" in line or "died" in line]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if r["step"] >= 0) == list(range(STEPS))
    assert max(r["engine/restarts"] for r in rows) == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["rollout_tokens_per_s"] > 0
    assert "rollout tokens/s: " in text  # printed in the run summary
    print(f"real SGLang main job: {summary['rollout_tokens_per_s']:.1f} rollout tokens/s "
          "(1 CPU engine, 2-core box, 6 steps of 8 x 2 samples, <= 32 tokens)")
    for name in ("reward", "throughput", "off_policy", "lengths"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 5_000, name
    assert 0.0 <= summary["off_policy_token_ratio"] < 1.0


def test_main_job_ledger_accounts_for_every_group(main_job):
    """The ledger audit of the last checkpoint."""
    assert main_job["rc"] == 0, main_job["text"][-3000:]
    run = main_job["run"]
    final = run / "ckpt" / f"iter_{STEPS - 1:07d}"
    buffer = json.loads((final / "buffer" / "buffer.json").read_text())
    ledger, reasons = buffer["ledger"]["state"], buffer["ledger"]["reason"]
    driver = json.loads((final / "driver_state.json").read_text())
    assert sorted(int(g) for g in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    assert set(ledger.values()) <= {"trained", "dropped", "parked", "finished"}
    assert all(reasons.get(g) for g, s in ledger.items() if s == "dropped")
    held = {int(s[0]["group_index"]) for s in buffer["parked"] + buffer["ready"]}
    assert held == {int(g) for g, s in ledger.items() if s in ("parked", "finished")}
    trained = []
    for rid in range(STEPS):
        groups = json.load(open(run.parent / "rollouts" / f"rollout_{rid}.json"))["groups"]
        assert len(groups) == 4
        trained += [g[0]["group_index"] for g in groups]
    assert len(trained) == len(set(trained)) == sum(1 for s in ledger.values() if s == "trained")
