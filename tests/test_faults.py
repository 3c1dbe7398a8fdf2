"""Faults a long run meets, on the quick-start task (train.py end to end, embedded engine behind sglang-router).

One faulty run carries most of them at once and must keep going: over-long data rows (dropped at load), a
reward that fails every sample of some prompts / blocks inside `async def` / raises CancelledError, an engine
killed with SIGKILL and later frozen with SIGSTOP (--use-fault-tolerance restarts it), listeners watched
throughout; then the driver is SIGKILLed (its engines, router and Ray agents must go with it), a planted
optimizer.pt and a changed data contract are refused, and `--load` finishes the run, audited against the ledger,
the rollout dumps and the data order. Two more runs must stop with an error naming the cause: a reward that
fails everywhere (--max-consecutive-empty-steps), an engine that keeps failing (--max-engine-restarts, after a
checkpoint). An unwritable --save fails at start.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "runs", "tiny")
STEPS = 6
BATCH, N = 8, 8
BAD_ROWS = (10, 30)  # over-long prompts inserted there: prompt + response budget > the model's positions

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def task(tmp_path_factory, quickstart_task):
    assert quickstart_task == TINY
    d = tmp_path_factory.mktemp("faults")
    rows = [json.loads(line) for line in open(os.path.join(TINY, "train.jsonl"))][:400]
    for at in BAD_ROWS:
        rows.insert(at, {"prompt": "99-1=" * 20, "label": "x", "metadata": {"n": 99, "s": 1, "steps": 98}})
    with open(d / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return d, rows


def _cmd(d, *extra, steps=STEPS, reward="tests.plugins_for_tests.faulty_subtract_chain", batch=BATCH, n=N):
    return [sys.executable, os.path.join(REPO, "train.py"),
            "--hf-checkpoint", os.path.join(TINY, "model-sft"), "--prompt-data", str(d / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--apply-chat-template", "--seed", "1",
            "--custom-rm-path", reward, "--reward-timeout", "1",
            "--num-rollout", str(steps), "--rollout-batch-size", str(batch), "--n-samples-per-prompt", str(n),
            "--rollout-max-response-len", "192", "--partial-rollout", "--over-sampling-batch-size", str(2 * batch),
            "--advantage-estimator", "grpo", "--calculate-per-token-loss", "--use-tis", "--lr", "1e-4",
            "--global-batch-size", str(batch * n), "--micro-batch-size", "16", "--no-use-wandb",
            "--use-fault-tolerance", "--rollout-health-check-interval", "2", "--rollout-health-check-timeout", "10",
            "--run-dir", str(d / "run"), "--save", str(d / "ckpt"), "--save-interval", "1",
            "--save-debug-rollout-data", str(d / "rollouts" / "rollout_{rollout_id}.json"), *extra]


def _env():
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO}


def _steps_logged(d) -> list[int]:
    path = d / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return out


def _latest(d) -> int:
    p = d / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(p.read_text()) if p.exists() else -1


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _engine_pids(driver_pid: int) -> list[int]:
    return [p.pid for p in _descendants(driver_pid) if "slime.backends.hf_engine" in _cmdline(p)]


def _wait(cond, timeout: float, what: str, proc=None, log=None, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"train.py exited ({proc.returncode}) while waiting for {what}:\n"
                                 + (open(log).read()[-4000:] if log else ""))
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}" + (f":\n{open(log).read()[-4000:]}" if log else ""))


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


class ListenerWatch:
    """Every listening socket any process of the job opens, while it runs."""

    def __init__(self, pid: int):
        self.pid, self.seen, self._stop = pid, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                procs = [psutil.Process(self.pid)] + _descendants(self.pid)
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    for c in p.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN:
                            self.seen.setdefault((c.laddr.ip, c.laddr.port), _cmdline(p)[:120])
                except psutil.Error:
                    continue
            self._stop.wait(0.3)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)


# ---------------------------------------------------------------- the faulty run ----
@pytest.fixture(scope="module")
def faulty_run(task):
    d, _ = task
    log = d / "first.log"
    proc = subprocess.Popen(_cmd(d), cwd=REPO, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    watch = ListenerWatch(proc.pid)
    out = {"log": log}
    try:
        # 1. kill -9 the engine after step 1: the fault-tolerant run restarts it and goes on
        _wait(lambda: 1 in _steps_logged(d), 400, "step 1", proc, log)
        first = _engine_pids(proc.pid)
        assert len(first) == 1, (first, [(p.pid, _cmdline(p)[:120]) for p in _descendants(proc.pid)],
                                 log.read_text()[-3000:])
        os.kill(first[0], signal.SIGKILL)
        # 2. freeze the restarted engine after step 2 (SIGSTOP): noticed, killed, restarted
        _wait(lambda: 2 in _steps_logged(d) and _engine_pids(proc.pid) not in ([], first), 400, "step 2", proc, log)
        second = _engine_pids(proc.pid)
        os.kill(second[0], signal.SIGSTOP)
        out["frozen_pid"] = second[0]
        _wait(lambda: _engine_pids(proc.pid) not in ([], second), 120, "the frozen engine's replacement", proc, log)
        # 3. kill -9 the buffer actor: a new one starts from the newest checkpoint and replays the calls since
        (buffer,) = [p for p in _descendants(proc.pid) if "ray::PartialRolloutBuffer" in _cmdline(p)]
        buffer.send_signal(signal.SIGKILL)
        _wait(lambda: "buffer actor restarted from" in log.read_text(), 300, "the buffer's restart", proc, log)
        out["buffer_restarted_in"] = len(_steps_logged(d))  # the step whose row is the first to count it
        # 4. kill -9 the driver once step 3 and that step are checkpointed: everything it started goes with it
        _wait(lambda: _latest(d) >= max(3, out["buffer_restarted_in"]), 400, "checkpoint 3", proc, log)
        job = _descendants(proc.pid)
        out["job"] = [(p.pid, _cmdline(p)) for p in job]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        out["killed_at"] = _latest(d)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in job):
            time.sleep(0.2)
        out["survivors"] = [(p.pid, _cmdline(p)) for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        watch.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out["listeners"] = watch.seen
    return out


def test_every_listener_of_the_job_is_on_loopback(faulty_run):
    seen = faulty_run["listeners"]
    outside = {addr: cmd for addr, cmd in seen.items() if not _is_loopback(addr[0])}
    assert not outside, f"listening outside loopback: {outside}"
    cmds = " ".join(seen.values())
    # the sockets this was about were there to be checked: trainer stores / gloo, engine, router, Ray
    assert "FSDPTrainer" in cmds and "hf_engine" in cmds and "raylet" in cmds and "router" in cmds


def test_engine_kill_and_freeze_are_survived_and_named(faulty_run, task):
    d, _ = task
    text = faulty_run["log"].read_text()
    assert "engine 0 (http://127.0.0.1:" in text and "exited with code -9 (killed by SIGKILL)" in text
    assert "is stopped (pid" in text and "SIGSTOP" in text
    # the frozen engine was replaced because its stop was seen (its process state), not after a health timeout
    frozen = faulty_run["frozen_pid"]
    assert re.search(rf"restart 2/\d+: engine 0 \(http://127\.0\.0\.1:\d+\) is stopped \(pid {frozen} in state T", text), \
        [line for line in text.splitlines() if "restart" in line or "is stopped" in line]
    rows = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    assert max(r["engine/restarts"] for r in rows) == 2
    assert all(r["data/dropped_rows/over_context_length"] == len(BAD_ROWS) for r in rows if r["step"] >= 0)


def test_a_killed_driver_takes_its_engines_router_and_ray_agents_along(faulty_run):
    assert any("ray::DashboardAgent" in c or "ray::RuntimeEnvAgent" in c for _, c in faulty_run["job"])
    assert faulty_run["survivors"] == []


def test_planted_checkpoint_and_changed_data_contract_are_refused_before_anything_starts(faulty_run, task):
    d, _ = task
    k = faulty_run["killed_at"]
    newest = d / "ckpt" / f"iter_{k:07d}" / "trainer" / "optimizer.pt"
    shutil.copy(newest, d / "optimizer.pt.good")
    marker = d / "PLANTED_PAYLOAD_RAN"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"state": Payload()}, newest)
    out = subprocess.run(_cmd(d, "--load", str(d / "ckpt")), cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"iter_{k:07d}/trainer/optimizer.pt: refused to load" in out.stderr
    assert f"resume from it with --ckpt-step {k - 1}" in out.stderr
    assert not marker.exists()
    _assert_refused_before_anything_started(out.stderr)
    shutil.copy(d / "optimizer.pt.good", newest)

    stale = d / "ckpt" / "iter_0000099.tmp-4999999"  # left by a run killed mid-save (that pid is gone)
    (stale / "trainer").mkdir(parents=True)
    out = subprocess.run(_cmd(d, "--load", str(d / "ckpt"), n=4), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and "--n-samples-per-prompt was 8, now 4" in out.stderr, out.stderr[-3000:]
    _assert_refused_before_anything_started(out.stderr)
    assert not stale.exists()


def _assert_refused_before_anything_started(stderr: str) -> None:
    """None of the lines a run logs as it starts Ray, its placement group, engines or trainers."""
    started = [s for s in ("ray initialised", "placement group:", "EngineGroup", "trainer rank(s) ready", "Trainer")
               if s in stderr]
    assert not started, f"refused only after {started} started:\n{stderr[-3000:]}"


def test_resume_finishes_the_run_and_the_ledger_audit_passes(faulty_run, task):
    d, rows = task
    k = faulty_run["killed_at"]
    done = subprocess.run(_cmd(d, "--load", str(d / "ckpt")), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"at rollout {k + 1}" in done.stderr + done.stdout
    assert _latest(d) == STEPS - 1

    final = d / "ckpt" / f"iter_{STEPS - 1:07d}"
    buffer = json.loads((final / "buffer" / "buffer.json").read_text())
    ledger, reasons = buffer["ledger"]["state"], buffer["ledger"]["reason"]
    driver = json.loads((final / "driver_state.json").read_text())
    # every group the data source issued has exactly one state; none is left issued (lost)
    assert sorted(int(g) for g in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    assert set(ledger.values()) <= {"trained", "dropped", "parked", "finished"}
    dropped = {int(g): reasons[g] for g, s in ledger.items() if s == "dropped"}
    assert dropped and all(r == "reward_failed: ZeroDivisionError: division by zero" for r in dropped.values())
    held = {int(s[0]["group_index"]) for s in buffer["parked"] + buffer["ready"]}
    assert held == {int(g) for g, s in ledger.items() if s in ("parked", "finished")}

    # data order: group g is the g-th usable row (the over-long rows skipped, nothing repeated or shifted)
    usable = [i for i in range(len(rows)) if i not in BAD_ROWS]
    trained = []
    for rid in range(STEPS):
        for g in json.load(open(d / "rollouts" / f"rollout_{rid}.json"))["groups"]:
            gid = g[0]["group_index"]
            assert all(s["metadata"]["row"] == usable[gid] and s["group_index"] == gid for s in g)
            assert rows[usable[gid]]["metadata"]["n"] % 10 != 7  # failed groups never reach the trainer
            trained.append(gid)
    assert len(trained) == len(set(trained)) == sum(1 for s in ledger.values() if s == "trained")
    for gid in dropped:
        assert rows[usable[gid]]["metadata"]["n"] % 10 == 7
    assert driver["rollout"]["policy_version"] == STEPS  # no empty step: every step trained

    # the reward faults that only fail one sample were contained (the rest of the group trained)
    failures = [s["metadata"].get("failure", "") for rid in range(STEPS)
                for g in json.load(open(d / "rollouts" / f"rollout_{rid}.json"))["groups"] for s in g]
    assert any("TimeoutError" in f for f in failures) and any("CancelledError" in f for f in failures)
    # metrics.jsonl / rollout_trace.jsonl hold each step once (the re-run steps replaced, not appended)
    assert _steps_logged(d) == list(range(STEPS))
    trace = [json.loads(line)["rollout_id"] for line in open(d / "run" / "rollout_trace.jsonl")]
    assert sorted(set(trace)) == list(range(STEPS)) and len(trace) >= STEPS


def test_a_killed_buffer_actor_restarts_from_its_checkpoint_and_loses_nothing(faulty_run, task):
    """The new actor started from the newest checkpoint's buffer and ledger and replayed the calls since (the
    engine, router and trainer kept running: the run went on); every checkpoint from there audits clean, and the
    groups parked in them reached training with their parked tokens (resumed, never generated again)."""
    from slime.utils.ledger_audit import audit_checkpoint

    d, _ = task
    text, step = faulty_run["log"].read_text(), faulty_run["buffer_restarted_in"]
    assert re.search(r"restart 3/\d+: the buffer actor died \(ActorDiedError\)", text), text[-3000:]
    base, replayed = re.search(r"buffer actor restarted from \S*iter_(\d+)/buffer/buffer\.json: replayed (\d+) ",
                               text).groups()
    assert step - 2 <= int(base) < step and int(replayed) > 0  # save interval 1: the step it died in (or its save)
    rows = {r["step"]: r for r in map(json.loads, open(d / "run" / "metrics.jsonl"))}
    assert rows[step]["restarts/buffer"] == 1 and max(r["restarts/buffer"] for r in rows.values()) == 1
    trained = {g[0]["group_index"]: g for rid in range(STEPS)
               for g in json.load(open(d / "rollouts" / f"rollout_{rid}.json"))["groups"]}
    resumed = 0
    for j in range(step - 1, STEPS):
        ckpt = d / "ckpt" / f"iter_{j:07d}"
        audit_checkpoint(str(ckpt))  # raises naming what is wrong
        for g in json.loads((ckpt / "buffer" / "buffer.json").read_text())["parked"]:
            if g[0]["group_index"] in trained:
                resumed += 1
                by_index = {s["index"]: s for s in trained[g[0]["group_index"]]}
                assert all(by_index[s["index"]]["tokens"][:len(s["tokens"])] == s["tokens"] for s in g)
    assert resumed > 0


# ------------------------------------------------------------ runs that must stop ----
def test_a_reward_failing_everywhere_stops_the_run_naming_the_cause(task, tmp_path):
    d, _ = task
    cmd = _cmd(d, "--max-consecutive-empty-steps", "2", steps=5, batch=4, n=4,
               reward="tests.plugins_for_tests.always_failing_reward")
    cmd = [a if a != str(d / "run") else str(tmp_path / "run") for a in cmd]
    cmd = [a if a != str(d / "ckpt") else str(tmp_path / "ckpt") for a in cmd]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "2 rollout steps in a row trained nothing" in out.stderr
    m = re.search(r"(\d+) of (\d+) groups dropped for reward_failed \(most often: 'reward_failed: ZeroDivisionError", out.stderr)
    assert m and m[1] == m[2] and int(m[1]) >= 8  # every group of both steps (one may finish past the target)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0]  # the second empty step stopped the run before being logged
    assert rows[0]["train/skipped_empty_steps"] == 1 and not any(k.startswith("weight_sync/") for k in rows[0])
    assert rows[0]["ledger/dropped/reward_failed"] >= 4 and rows[0]["ledger/trained"] == 0


def test_an_engine_that_keeps_failing_checkpoints_then_stops_naming_it(task, tmp_path):
    d, _ = task
    cmd = _cmd(d, "--max-engine-restarts", "0", steps=6, batch=4, n=4)
    cmd = [str(tmp_path / "run") if a == str(d / "run") else str(tmp_path / "ckpt") if a == str(d / "ckpt") else a
           for a in cmd]
    log = tmp_path / "log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        run = tmp_path / "run" / "metrics.jsonl"
        _wait(lambda: run.exists() and len(run.read_text().splitlines()) >= 2, 400, "step 1", proc, str(log))
        os.kill(_engine_pids(proc.pid)[0], signal.SIGSTOP)
        assert proc.wait(timeout=300) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "giving up after 0 restart(s) (--max-engine-restarts 0" in text and "is stopped" in text
    last = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    buffer = json.loads((tmp_path / "ckpt" / f"iter_{last:07d}" / "buffer" / "buffer.json").read_text())
    assert "issued" not in buffer["ledger"]["state"].values()  # the failed step's groups parked, none lost
    assert "saved checkpoint" in text.split("engine watchdog")[-1]  # written after the fault, before stopping


def test_unwritable_save_dir_fails_at_start(task, tmp_path):
    d, _ = task
    (tmp_path / "file").write_text("x")
    cmd = [str(tmp_path / "file" / "ckpt") if a == str(d / "ckpt") else a for a in _cmd(d)]
    out = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"--save {tmp_path / 'file' / 'ckpt'}: not writable (Not a directory" in out.stderr
    # at start: refused before Ray, an engine or a trainer was started
    _assert_refused_before_anything_started(out.stderr)
