"""One part of a run killed at a time, on the fault suite's task (tests/test_faults.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import psutil
import pytest
from test_faults import _cmd, _descendants, _env, _steps_logged, _wait, task  # noqa: F401 - `task` is a fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job(proc, word: str) -> list[psutil.Process]:
    out = []
    for p in _descendants(proc.pid):
        try:
            if word in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


GATED = ("--custom-rm-path", "tests.plugins_for_tests.gated_subtract_chain", "--reward-timeout", "600")


def _hold_from(d, version: int | None) -> None:
    """Rewards of samples of policy `version` or later wait (tests.plugins_for_tests.gated_subtract_chain)."""
    gate = d / "run" / "gate"
    gate.mkdir(parents=True, exist_ok=True)
    if version is None:
        (gate / "hold").unlink()
        return
    (gate / "hold.tmp").write_text(str(version))
    (gate / "hold.tmp").replace(gate / "hold")


def _held(d, version: int, proc, log, what: str) -> int:
    """Waits until the run holds a sample of policy `version` or later."""
    def versions() -> list[int]:
        return [v for p in (d / "run" / "gate").glob("held-*") if (v := int(p.name[5:])) >= version]

    _wait(lambda: versions(), 400, what, proc, log)
    return min(versions())


def _kill_router(proc) -> int:
    (router,) = _job(proc, "sglang::router")
    router.send_signal(signal.SIGKILL)
    return router.pid


def test_a_dead_router_stops_the_run_naming_it_and_train_log_ends_with_why(task, tmp_path):
    d = tmp_path
    (d / "train.jsonl").symlink_to(task[0] / "train.jsonl")
    cmd = [a for a in _cmd(d, "--debug-rollout-only", *GATED, steps=40, batch=4, n=4) if a != "--use-fault-tolerance"]
    log = tmp_path / "log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        # the router dies while a step after the first one is generating (rollout only: the policy stays at 0)
        _wait(lambda: 0 in _steps_logged(d), 400, "step 0", proc, str(log))
        _hold_from(d, 0)
        _held(d, 0, proc, str(log), "a later step's rollout")
        pid = _kill_router(proc)
        _hold_from(d, None)
        assert proc.wait(timeout=300) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    # the run's own lines (Ray's log monitor may still print its workers' lines, "(raylet) ...", after them)
    stderr = [line for line in log.read_text().rstrip().splitlines() if line and not line.startswith(("(", " ", "\t"))]
    named = rf"the sglang-router at http://127\.0\.0\.1:\d+ \(pid {pid}\) exited with code -9 \(killed by SIGKILL\)"
    # mid-step: "rollout step N failed: <the router named>"; the router named first either way
    assert stderr[-1].startswith("train.py: error: ") and re.search(named, stderr[-1]), stderr[-5:]
    assert "--use-fault-tolerance would restart it" in stderr[-1] and "resumes at step" in stderr[-1]
    assert "EngineUnreachableError" not in stderr[-1]  # the router is named, not the refused connection
    train_log = (d / "run" / "train.log").read_text().rstrip().splitlines()
    assert train_log[-1].split(" ERROR train: stopped: ")[1] == stderr[-1].split("train.py: error: ")[1]


def test_router_and_trainer_killed_under_fault_tolerance_keep_the_engines_and_train_each_group_once(task, tmp_path):
    d = tmp_path
    (d / "train.jsonl").symlink_to(task[0] / "train.jsonl")
    steps = 16  # checkpoints after steps 2, 5, 8, 11, 14 and the last
    # groups generated while a reward is held wait for it, then are trained as the next steps' overflow, which
    # generate nothing and cannot be held: the over-sampling only the batch keeps that to a step or two (then held
    # steps may come every other step: an interval of 3 cannot keep in step with them)
    cmd = _cmd(d, "--save-interval", "3", *GATED, "--over-sampling-batch-size", "4", steps=steps, batch=4, n=4)
    _hold_from(d, 1)  # the first rollout that generates after a step trained waits for the test
    log = tmp_path / "log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        version = _held(d, 1, proc, str(log), "a rollout after step 0")
        router = _kill_router(proc)
        _hold_from(d, version + 1)  # let it go on; hold the next rollout that generates
        _wait(lambda: "sglang-router restarted" in log.read_text(), 300, "the router's restart", proc, str(log))
        # then, in the rollout of a step k + 1 whose step k is trained but not checkpointed (one before it is), kill
        # the trainer: its next call (step k + 1's training, typically) finds it dead, and the steps since the
        # checkpoint are replayed from the object store, not generated again
        while True:
            version = _held(d, version + 1, proc, str(log), "a later rollout")
            k = len(_steps_logged(d)) - 1
            if k > 2 and not (d / "ckpt" / f"iter_{k:07d}").exists():
                break
            _hold_from(d, version + 1)
        assert _steps_logged(d) == list(range(k + 1)) and k < steps - 1
        (trainer,) = _job(proc, "FSDPTrainer")
        serving = {p.pid: p.create_time() for p in _job(proc, "hf_engine") + _job(proc, "sglang::router")}
        trainer.send_signal(signal.SIGKILL)
        _hold_from(d, None)
        _wait(lambda: "trainer restarted" in log.read_text(), 300, "the trainer's restart", proc, str(log))
        after = {p.pid: p.create_time() for p in _job(proc, "hf_engine") + _job(proc, "sglang::router")}
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert after == serving and len(serving) == 2  # the engine and the (restarted) router: the same processes
    text = log.read_text()
    assert re.search(rf"restart 1/\d+: the sglang-router at http://127\.0\.0\.1:\d+ \(pid {router}\) exited with code -9",
                     text)
    died = re.search(rf"restart 2/\d+: trainer\.(\w+): trainer rank 0 \(pid {trainer.pid}\) failed: its process died", text)
    assert died, text[-3000:]
    # the trainer restarts from the newest checkpoint and replays every step trained since, from the object store
    # (the rollout dumps below show none generated again)
    restarted = re.search(r"trainer restarted \(pids \[[^\]]*\]\) from \S*iter_(\d+)/trainer; replayed steps \[([\d, ]*)\]",
                          text)
    ckpt, replayed = int(restarted[1]), [int(x) for x in restarted[2].split(",") if x.strip()]
    assert ckpt == 3 * ((k + 1) // 3) - 1 and replayed == list(range(ckpt + 1, k + 1)), (k, ckpt, replayed)
    rows = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(steps))
    assert rows[-1]["restarts/router"] == 1 and rows[-1]["engine/restarts"] == 0
    # the restart is counted from the first row written after it was found: the row of the step whose training
    # found it, or the next one after a checkpoint's save found it (none after the last step's: the summary has it)
    counts = [r["restarts/trainer"] for r in rows]
    assert counts == sorted(counts) and set(counts) <= {0, 1} and counts[:k + 1] == [0] * (k + 1)
    if died[1] in ("train", "save"):
        assert (counts + [1]).index(1) == (replayed[-1] if replayed else ckpt) + 1, (died[1], counts, replayed)
    summary = json.loads((d / "run" / "summary.json").read_text())
    assert summary["restarts"] == {"engine": 0, "router": 1, "trainer": 1, "buffer": 0}

    # every step generated once (one dump each, the step's rollout never re-run), every group trained once
    assert [m for m in re.findall(r"saved rollout (\d+) to", text)] == [str(i) for i in range(steps)]
    final = d / "ckpt" / f"iter_{steps - 1:07d}"
    ledger = json.loads((final / "buffer" / "buffer.json").read_text())["ledger"]["state"]
    trained = [g[0]["group_index"] for i in range(steps)
               for g in json.load(open(d / "rollouts" / f"rollout_{i}.json"))["groups"]]
    assert len(trained) == len(set(trained)) == sum(1 for s in ledger.values() if s == "trained")
    assert {str(g) for g in trained} == {g for g, s in ledger.items() if s == "trained"}
    driver = json.loads((final / "driver_state.json").read_text())
    assert driver["rollout"]["policy_version"] == steps
