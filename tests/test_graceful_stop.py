"""A polite stop (slime/utils/graceful_stop.py, docs/faults.md) on the quick start's task, embedded engine."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import psutil
import pytest
from test_faults import _cmd, _descendants, _env, _steps_logged, _wait, task  # noqa: F401 - `task` is a fixture
from test_part_faults import _hold_from, _job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# each chain's --num-rollout: train.py's ends at its --exit-interval (step 5), train_async.py's final run trains step 4
STEPS = {"train.py": 7, "train_async.py": 5}
# (--rollout-mode, the phase the signal lands in, the signal) for each stopped run of a chain; a push is caught
# as the run's first one forms its weight-update group, so it leads its chain
CHAINS = {
    "train.py": [("chunked", "weight push", signal.SIGTERM), ("chunked", "rollout", signal.SIGTERM),
                 ("chunked", "training", signal.SIGINT), ("chunked", "second signal", signal.SIGTERM),
                 ("chunked", "exit interval", None)],
    "train_async.py": [("pool", "weight push", signal.SIGINT), ("stream", "rollout", signal.SIGINT),
                       ("chunked", "training", signal.SIGTERM)],
}


def _chain_cmd(d, entry: str, mode: str, *extra, steps: int) -> list[str]:
    cmd = _cmd(d, "--rollout-ignore-eos", "--rollout-max-response-len", "96", "--sglang-server-concurrency", "4",
               "--custom-rm-path", "tests.plugins_for_tests.gated_subtract_chain", "--reward-timeout", "600",
               "--rollout-mode", mode, *extra, steps=steps, batch=2, n=4)
    cmd.remove("--use-fault-tolerance")
    if mode != "chunked":  # pool and stream keep --rollout-pool-size requests in flight instead
        at = cmd.index("--over-sampling-batch-size")
        cmd[at:at + 2] = ["--rollout-pool-size", "4"]
    return [os.path.join(REPO, entry) if a.endswith("/train.py") else a for a in cmd]


def _buffer(d, step: int) -> dict:
    return json.loads((d / "ckpt" / f"iter_{step:07d}" / "buffer" / "buffer.json").read_text())


def _stopped_run(d, entry: str, mode: str, phase: str, sig: int, start: int, options: tuple, steps: int) -> dict:
    """One run from step `start` (a --load resume unless 0), stopped by `sig` in `phase` of step `at`."""
    at = start if phase in ("weight push", "exit interval") else start + 1
    assert phase != "weight push" or start == 0
    extra = ["--load", str(d / "ckpt")] if start else []
    if phase == "weight push":  # one weight bucket per tensor: the push takes long enough to be caught in it
        extra += ["--update-weight-buffer-size", "4096"]
    if phase == "exit interval":  # no signal: Megatron-LM's flag stops it after its first step
        extra += ["--exit-interval", str(start + 1)]
    for old in (d / "rollouts").glob("rollout_*.json"):  # a halted step's dump is rewritten when it runs again
        if int(old.stem.split("_")[1]) >= start:
            old.unlink()
    if phase == "rollout":
        _hold_from(d, at)  # step `at`'s rewards wait (its rollout runs at policy version `at`)
    log = d / f"stop-{start}.log"
    proc = subprocess.Popen(_chain_cmd(d, entry, mode, *extra, *options, steps=steps), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    out = {"log": log, "start": start, "at": at}
    try:
        trainer = None
        if phase == "exit interval":
            _wait(lambda: "resumed from" in log.read_text(), 400, "the resume", proc, str(log))
        elif phase == "rollout":
            _wait(lambda: any(int(p.name[5:]) >= at for p in (d / "run" / "gate").glob("held-*")), 400,
                  f"step {at}'s rollout", proc, str(log))
        else:  # the step's batch is made (its dump) / the engine joined the push: freeze the trainer there
            engine_log = d / "run" / "engine_logs" / "engine_0.log"
            ready = ((lambda: engine_log.exists() and "weight update group" in engine_log.read_text())
                     if phase == "weight push" else (lambda: (d / "rollouts" / f"rollout_{at}.json").exists()))
            _wait(ready, 400, f"step {at}'s {phase}", proc, str(log), poll=0.005)
            (trainer,) = _job(proc, "FSDPTrainer")
            trainer.send_signal(signal.SIGSTOP)
        out["job"] = _descendants(proc.pid)
        out["job_cmds"] = [" ".join(p.cmdline()) for p in out["job"]]
        if sig is None:
            pass
        elif sig == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole foreground group
        else:
            proc.send_signal(sig)
        if sig is not None:
            _wait(lambda: "stopping at the next safe point" in log.read_text(), 60, "the stop's first line", proc,
                  str(log))
        if phase == "second signal":  # while the training call still runs
            proc.send_signal(sig)
            proc.wait(timeout=120)
        if trainer is not None and trainer.is_running():
            trainer.send_signal(signal.SIGCONT)
        if phase == "rollout":
            _hold_from(d, None)
        out["rc"] = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    out["survivors"] = _survivors(out["job"])
    # what the stop left, before the next run of the chain moves on
    m = re.search(r"stopped after step (\d+)", log.read_text())
    out["done"] = done = int(m[1]) if m else None
    out["resumes_at"] = int(re.findall(r"resumes at step (\d+)", log.read_text())[-1])
    out["rows"] = [json.loads(line) for line in open(d / "run" / "metrics.jsonl")]
    out["latest"] = (d / "ckpt" / "latest_checkpointed_iteration.txt").read_text()
    out["train_log"] = (d / "run" / "train.log").read_text().rstrip().splitlines()[-3:]
    out["buffer"] = _buffer(d, done) if done is not None and (d / "ckpt" / f"iter_{done:07d}").is_dir() else None
    return out


def _survivors(job: list[psutil.Process]) -> list[str]:
    def alive() -> list[psutil.Process]:
        return [p for p in job if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    try:
        _wait(lambda: not alive(), 30, "the job's processes to go")
    except AssertionError:
        pass
    return [" ".join(p.cmdline())[:160] for p in alive()]


@pytest.fixture(scope="module", params=list(CHAINS))
def chain(request, task, tmp_path_factory):
    entry = request.param
    d = tmp_path_factory.mktemp(entry.replace(".", "_"))
    (d / "train.jsonl").symlink_to(task[0] / "train.jsonl")
    runs, start = [], 0
    for mode, phase, sig in CHAINS[entry]:
        run = _stopped_run(d, entry, mode, phase, sig, start, (), STEPS[entry])
        run.update(entry=entry, mode=mode, phase=phase, sig=sig)
        runs.append(run)
        assert run["resumes_at"] >= start, run["log"].read_text()[-3000:]
        start = run["resumes_at"]
    if runs[-1]["phase"] == "exit interval":  # it ends the chain (exit 0, checkpointed): the audit is of its checkpoint
        return {"d": d, "entry": entry, "runs": runs, "end": runs[-1]["done"]}
    final = subprocess.run(_chain_cmd(d, entry, "chunked", "--load", str(d / "ckpt"), steps=STEPS[entry]), cwd=REPO,
                           env=_env(), capture_output=True, text=True, timeout=600)
    return {"d": d, "entry": entry, "runs": runs, "final": final, "end": STEPS[entry] - 1}


@pytest.mark.parametrize("i", range(3), ids=["weight_push", "rollout", "training"])  # (each chain's first three)
def test_a_stop_checkpoints_says_why_and_leaves_nothing_behind(chain, i):
    check_stop(chain, chain["runs"][i])


def check_stop(chain, run) -> None:
    """Exit code, where it stopped, the checkpoint, the last line of train.log and the console, no process left."""
    d, text = chain["d"], run["log"].read_text()
    assert run["rc"] == (0 if run["sig"] is None else 128 + run["sig"]), text[-3000:]
    done = run["done"]
    why = (f"--exit-interval {done + 1}: step {done} done" if run["sig"] is None else
           f"{'SIGINT (Ctrl-C)' if run['sig'] == signal.SIGINT else 'SIGTERM'} received")
    # where it stopped: a training call or a push finishes its step; a halted rollout leaves its step undone (in
    # train_async.py the trainer may be training the step before it, which then finishes)
    assert done == run["at"] or (run["phase"] == "rollout" and done == run["at"] - 1), text[-3000:]
    assert [r["step"] for r in run["rows"]] == list(range(done + 1)) and int(run["latest"]) == done
    ckpt_lines = re.findall(rf"slime.utils.checkpoint: saved checkpoint \S*iter_{done:07d}", text)
    if run["phase"] != "rollout":  # it landed in the call: the step's own checkpoint is the stop's, written once
        assert len(ckpt_lines) == 1, ckpt_lines
        pushed = run["phase"] in ("weight push", "exit interval")  # (a stop in the training call skips the push)
        assert any(k.startswith("weight_sync/") for k in run["rows"][-1]) == pushed
    ckpt = d / "ckpt" / f"iter_{done:07d}"
    buffer = run["buffer"]
    held = f"{len(buffer['parked'])} parked and {len(buffer['ready'])} ready groups in its buffer"
    reason = (f"{why}; stopped after step {done} (everything in flight parked): saved checkpoint {ckpt} "
              f"({held}); `--load {d / 'ckpt'}` resumes at step {done + 1}")
    train_log = run["train_log"]
    assert train_log[-1].endswith(f" WARNING train: stopped: {reason}"), train_log[-3:]
    stderr = text.rstrip().splitlines()
    assert stderr[-1] == f"{chain['entry']}: stopped: {reason}", stderr[-5:]
    assert "Traceback" not in text and "SIGTERM received at time" not in text  # no crash trace (Ray's or ours)
    cmds = " ".join(run["job_cmds"])
    assert ("hf_engine" in cmds or "sglang.launch_server" in cmds) and "router" in cmds and "FSDPTrainer" in cmds
    assert "raylet" in cmds
    assert run["survivors"] == []
    assert "issued" not in buffer["ledger"]["state"].values()  # every group the stopped run took is accounted for
    if run["phase"] == "rollout":
        assert buffer["parked"]
    if run["phase"] == "rollout" and chain["entry"] == "train.py":  # the halted step's own tokens were parked
        assert any(run["at"] in s["weight_versions"] for g in buffer["parked"] for s in g)


def test_a_second_signal_stops_at_once_naming_the_checkpoint_to_resume_from(chain):
    runs = [r for r in chain["runs"] if r["phase"] == "second signal"]
    if not runs:
        pytest.skip(f"{chain['entry']}'s chain sends no second signal")
    d, run = chain["d"], runs[0]
    text, at = run["log"].read_text(), run["at"]
    assert run["rc"] == 128 + run["sig"], text[-3000:]
    reason = (f"SIGTERM received again while stopping (SIGTERM received): stopped at once; stopped in step {at}: "
              f"`--load {d / 'ckpt'}` resumes at step {at} (checkpoint iter_{at - 1:07d})")
    assert run["train_log"][-1].endswith(f" ERROR train: stopped: {reason}"), run["train_log"]
    assert text.rstrip().splitlines()[-1] == f"{chain['entry']}: stopped: {reason}"
    assert int(run["latest"]) == at - 1 and [r["step"] for r in run["rows"]] == list(range(at))  # nothing more saved
    assert run["survivors"] == []


def test_exit_interval_stops_after_its_step_checkpointed_and_exits_0(chain):
    runs = [r for r in chain["runs"] if r["phase"] == "exit interval"]
    if not runs:
        pytest.skip(f"{chain['entry']}'s chain has no --exit-interval run")
    check_stop(chain, runs[0])


def test_each_resume_takes_the_parked_samples_first_and_the_ledger_audit_passes(chain):
    check_resumes(chain)


def check_resumes(chain) -> None:
    """Each resume starts where its stop said, takes what the stop held first, keeps the parked tokens."""
    d, runs, end = chain["d"], chain["runs"], chain["end"]
    after = [r["log"].read_text() for r in runs[1:]]
    if "final" in chain:
        assert chain["final"].returncode == 0, chain["final"].stderr[-3000:]
        after.append(chain["final"].stderr)
    for run, resumed in zip(runs, after):
        assert f"at rollout {run['resumes_at']}" in resumed
    # (the second signal saved nothing; the last stop of a chain that ends with it has nothing after it)
    runs = [r for r in runs if r["phase"] != "second signal" and r["done"] < end]
    assert _steps_logged(d) == list(range(end + 1))
    # every sample parked by a stop reaches training with the tokens it had (resumed, never generated again)
    trained = {}
    for rid in range(end + 1):
        for g in json.load(open(d / "rollouts" / f"rollout_{rid}.json"))["groups"]:
            assert g[0]["group_index"] not in trained, f"group {g[0]['group_index']} trained twice"
            trained[g[0]["group_index"]] = g
    final_buffer = _buffer(d, end)
    still = {g[0]["group_index"] for g in final_buffer["parked"] + final_buffer["ready"]}
    resumed = 0
    for run in runs:
        held = {g[0]["group_index"] for g in run["buffer"]["parked"] + run["buffer"]["ready"]}
        first = [g[0]["group_index"] for g in json.load(open(d / "rollouts" / f"rollout_{run['done'] + 1}.json"))["groups"]]
        # the resumed run's first step takes what the stop held first
        assert len(set(first) & held) == min(len(first), len(held)), (first, held)
        for g in run["buffer"]["parked"]:
            gid = g[0]["group_index"]
            assert gid in trained or gid in still, f"group {gid}, parked by the stop after step {run['done']}, is lost"
            if gid in trained:
                resumed += 1
                by_index = {s["index"]: s for s in trained[gid]}
                for s in g:
                    assert by_index[s["index"]]["tokens"][:len(s["tokens"])] == s["tokens"], (gid, s["index"])
    assert resumed > 0
    ledger = final_buffer["ledger"]["state"]
    driver = json.loads((d / "ckpt" / f"iter_{end:07d}" / "driver_state.json").read_text())
    assert sorted(int(g) for g in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    assert set(ledger.values()) <= {"trained", "dropped", "parked", "finished"}
    assert {int(g) for g, s in ledger.items() if s == "trained"} == set(trained)
    assert still == {int(g) for g, s in ledger.items() if s in ("parked", "finished")}

