"""What the GPU main job (benchmarks/gpu_main_job.sh) prints from a run's files."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from slime.rollout.buffer import PartialRolloutBuffer
from slime.utils import checkpoint as ckpts
from slime.utils.ledger import DROPPED, FINISHED, TRAINED, LedgerError
from slime.utils.ledger_audit import audit_checkpoint, audit_save_dir
from slime.utils.types import Sample, Status

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def group(gid: int, finished: bool) -> list[Sample]:
    out = []
    for i in range(2):
        s = Sample(index=2 * gid + i, group_index=gid, tokens=[1, 2, 3])
        s.status = Status.COMPLETED if finished else Status.ABORTED
        out.append(s)
    return out


def save(tmp_path, buffer: PartialRolloutBuffer, issued: int, step: int = 3) -> str:
    return ckpts.save_checkpoint(str(tmp_path / "ckpt"), step, {"buffer": lambda d: buffer.save(os.path.join(d, "buffer.json"))},
                                 {"rollout_id": step, "rng": {}, "rollout": {"policy_version": step + 1, "data_source": {
                                     "epoch": 0, "offset": issued, "group_counter": issued, "sample_counter": 2 * issued}}})


def step_of_five() -> PartialRolloutBuffer:
    """Groups 0-4 issued: 0 and 1 trained, 2 dropped, 3 parked unfinished, 4 finished and held ready."""
    b = PartialRolloutBuffer()
    b.issue([group(g, False) for g in range(5)])
    b.mark([0, 1], FINISHED)
    b.mark([0, 1], TRAINED)
    b.mark([2], DROPPED, reason="reward_failed: ValueError")
    b.park([group(3, False)])
    b.mark([4], FINISHED)
    b.hold_ready([group(4, True)])
    return b


def test_a_clean_checkpoint_passes_the_audit(tmp_path):
    ckpt = save(tmp_path, step_of_five(), issued=5)
    counts = audit_checkpoint(ckpt)
    assert (counts["trained"], counts["dropped"], counts["parked"], counts["finished"], counts["data_groups"]) == (2, 1, 1, 1, 5)
    assert audit_save_dir(str(tmp_path / "ckpt"))[0] == ckpt
    out = subprocess.run([sys.executable, "tools/audit_ledger.py", str(tmp_path / "ckpt")], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr


def test_the_audit_names_a_lost_group_a_group_in_flight_and_a_group_held_twice(tmp_path):
    # the data source issued 6 groups; the ledger knows 5: group 5 was lost
    with pytest.raises(LedgerError, match=r"without a ledger state: \[5\]"):
        audit_checkpoint(save(tmp_path / "a", step_of_five(), issued=6))
    b = step_of_five()
    b.issue([group(5, False)])  # saved while group 5 was in flight
    with pytest.raises(LedgerError, match="still issued between steps"):
        audit_checkpoint(save(tmp_path / "b", b, issued=6))
    ckpt = save(tmp_path / "c", step_of_five(), issued=5)
    path = os.path.join(ckpt, "buffer", "buffer.json")
    state = json.load(open(path))
    state["ready"].append(state["ready"][0])  # the same group held twice
    json.dump(state, open(path, "w"))
    with pytest.raises(LedgerError, match="held twice"):
        audit_checkpoint(ckpt)
    out = subprocess.run([sys.executable, "tools/audit_ledger.py", str(tmp_path / "c" / "ckpt")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "NOT clean" in out.stderr and "held twice" in out.stderr
    out = subprocess.run([sys.executable, "tools/audit_ledger.py", str(tmp_path / "none")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no checkpoint" in out.stderr


def test_step_split_prints_each_steps_time_and_memory(tmp_path):
    spec = importlib.util.spec_from_file_location("step_split", os.path.join(REPO, "tools", "step_split.py"))
    step_split = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_split)
    step_split = step_split.step_split

    gib = 2**30
    rows = [{"step": -1, "eval/accuracy": 0.1},  # the eval before the first step: not a step
            {"step": 0, "perf/step_time_s": 10.0, "perf/rollout_s": 6.0, "perf/train_s": 2.0, "perf/weight_push_s": 0.4,
             "weight_sync/weight_sync_time_s": 0.3, "colocate/engine_release_s": 0.2, "colocate/trainer_onload_s": 0.5,
             "colocate/trainer_offload_s": 0.6, "colocate/engine_resume_s": 0.1, "colocate/engine_release_bytes": 3 * gib,
             "colocate/trainer_offload_bytes": 2 * gib, "weight_sync/weight_sync_bytes": gib},
            {"step": 1, "perf/step_time_s": 5.0, "perf/rollout_s": 3.0, "perf/train_s": 1.0, "perf/weight_push_s": 0.5}]
    split = step_split(rows)
    assert [r["step"] for r in split] == [0, 1]
    assert split[0]["other_s"] == pytest.approx(10.0 - (6 + 0.2 + 0.5 + 2 + 0.4 + 0.6 + 0.1))  # the updater is inside push
    assert split[1]["release_s"] is None and split[1]["other_s"] == pytest.approx(0.5)  # not colocated
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "tools/step_split.py", str(run), "--json", str(tmp_path / "split.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("step    0:") and "3.000" in lines[1] and "2.000" in lines[1]  # GiB released / offloaded
    assert json.load(open(tmp_path / "split.json"))[0]["push_s"] == 0.4
