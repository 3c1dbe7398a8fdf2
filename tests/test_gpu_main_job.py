"""benchmarks/gpu_main_job.sh --cpu-dry-run: every stage a GPU lease would run, run here on CPU with tiny settings,
with what the GPU box lacks made unimportable (Ray too, in the part that must not need it); and the wheel that
travels in two parts (benchmarks/wheel_parts.py) joined, checked and installed by the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from wheel_parts import join, split  # noqa: E402


def tiny_wheel(directory, name="gmj_probe", size=200_000) -> str:
    """A valid pure-Python wheel (incompressible padding, so that splitting it makes real parts)."""
    path = os.path.join(directory, f"{name}-1.0-py3-none-any.whl")
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{name}/pad.bin", os.urandom(size))
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_a_wheel_split_over_two_runs_is_joined_only_whole_and_checked(tmp_path):
    wheel = tiny_wheel(str(tmp_path))
    original = open(wheel, "rb").read()
    first, second = tmp_path / "run1", tmp_path / "run2"
    parts = split(wheel, 80_000, [str(first), str(second)])
    assert [os.path.getsize(p) for p in parts] == [80_000, len(original) - 80_000] and not os.path.exists(wheel)
    joined, missing = join([str(first)], str(tmp_path / "out"))  # the first run: half of it
    assert joined == [] and "part(s) [2] of 2 not here" in missing[0]
    joined, missing = join([str(first), str(second)], str(tmp_path / "out"))
    assert missing == [] and open(joined[0], "rb").read() == original
    with open(parts[1], "r+b") as f:  # a damaged part is refused, naming the wheel
        f.write(b"x")
    with pytest.raises(SystemExit, match="gmj_probe-1.0-py3-none-any.whl: sha256"):
        join([str(first), str(second)], str(tmp_path / "out2"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_main_jobs_dry_run_runs_every_stage_on_cpu(tmp_path):
    wheels = [tmp_path / "whl", tmp_path / "whl2"]
    split(tiny_wheel(str(tmp_path)), 80_000, [str(w) for w in wheels])  # the recipe Ray's wheel follows
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "OUT": str(out), "GPU_MAIN_JOB_WORK": str(work), "STEPS": "2",
           "GPU_MAIN_JOB_WHEELS": " ".join(str(w) for w in wheels)}
    res = subprocess.run(["bash", "benchmarks/gpu_main_job.sh", "--cpu-dry-run"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=880)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "joined gmj_probe-1.0-py3-none-any.whl" in log and (work / "site" / "gmj_probe" / "__init__.py").is_file()
    status = (out / "status_engine.txt").read_text() + (out / "status_train.txt").read_text()
    for stage in ("E1_step_off", "E1_step_static", "E2_rollout", "T1_main_job", "T2_stream"):
        assert f"{stage}: exit 0" in status, status
    acceptance = {**json.loads((out / "acceptance_engine.json").read_text()),
                  **json.loads((out / "acceptance_train.json").read_text())}
    assert acceptance and all(acceptance.values()), acceptance
    assert {"E1: greedy tokens unchanged with graphs", "E2: rollout benchmark ran on both workloads",
            "T1 main job (colocated): weight push and memory hand-back in every step",
            "T1 main job (colocated): ledger audit clean", "T2 stream (disaggregated): ledger audit clean"} <= set(acceptance)
    assert any(k.endswith("predicted every mode") for k in acceptance)
    split_rows = json.loads((out / "main_job_split.json").read_text())
    assert len(split_rows) == 2 and all(r["engine_released_bytes"] > 0 and r["trainer_offloaded_bytes"] > 0
                                        for r in split_rows)
    # part engine ran without Ray (made unimportable there, as on the GPU box before the second run)
    assert "ray is not installed on the GPU box" in (work / "missing-engine" / "ray" / "__init__.py").read_text()
