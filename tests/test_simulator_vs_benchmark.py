"""Acceptance: the simulator, calibrated on the engine in the same run, reproduces the rollout
benchmark's measured sync / APRIL / pool tokens/s within 15% (a small setting of
benchmarks/rollout_throughput.py with --simulate: calibration passes interleaved with its rounds).

The comparison is in wall-clock seconds, so it only means something when the engine had its core:
on a box oversubscribed by other work (the engine thread got under 70% of a CPU while the modes
ran, read from its own CPU-time counters), or whose CPU ran more than 8% slower or faster while a mode
ran than while calibrating (a fixed CPU probe on the engines' CPU, timed around both), the wall clock
measures the neighbours, and such a run is not counted.

A short run on this shared 2-core VM has outliers that neither check sees (2 of ~10 quiet-box runs put sync
at +16% / +26% while the other runs of the same code gave -1% to +5%): when the first run misses, a second
run (another seed) is made and the verdict is on the two pooled (each mode's simulated over measured tok/s,
summed over the runs), which is what one benchmark of twice the length would measure. A simulator off by
more than 15% in either direction fails both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1700)]

SMALL = ["--rounds", "2", "--min-seconds", "5", "--min-steps", "2", "--no-stale-kv-modes", "--probe-seconds", "1",
         "--probe-passes", "1", "--concurrencies", "16", "64", "--c-star", "64", "--scale", "8", "--simulate"]
MODES = ("sync", "april", "pool")
MIN_CPU_SHARE = 0.7
MAX_SPEED_DRIFT = 0.08
TOLERANCE = 0.15


def run_benchmark(tmp_path, seed: int) -> dict:
    """One small benchmark run; its `simulated` table after the checks that do not depend on the wall clock."""
    out = tmp_path / f"bench-{seed}.json"
    proc = subprocess.run([sys.executable, "rollout_throughput.py", *SMALL, "--seed", str(seed), "--json-out", str(out)],
                          cwd=os.path.join(REPO, "benchmarks"), capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = json.loads(out.read_text())["simulated"]
    for m in MODES:
        r = sim[m]
        assert r["measured_tok_s"] > 0 and r["sim_tok_s"] > 0, (m, r)
        # what the engine did does not depend on the wall clock: the simulated modes make the engine run the same
        # number of decode steps with the same batch (mode logic, admission, aborts, resumes), whatever the load
        assert r["sim_decode_steps"] == pytest.approx(r["measured_decode_steps"], rel=0.15), (m, r)
        assert r["sim_rows_per_step"] == pytest.approx(r["measured_rows_per_step"], rel=0.15), (m, r)
        assert r["box_speed_vs_calibration"] is not None and r["box_speed_vs_calibration"] > 0, (m, r)
    return sim


def wall_clock_problem(sim: dict) -> str | None:
    """Why this run's wall clock measured the neighbours rather than the engine (None: it is comparable)."""
    shares = [sim[m]["engine_cpu_share"] for m in MODES if sim[m]["engine_cpu_share"] is not None]
    if shares and min(shares) < MIN_CPU_SHARE:
        return f"box oversubscribed (engine CPU share {min(shares):.2f} < {MIN_CPU_SHARE})"
    # a shared host can slow this VM's CPU for tens of seconds with nothing showing inside it: a fixed CPU probe on
    # the engines' CPU, timed around the calibration and around each mode, says whether the box ran at one speed
    drift = {m: sim[m]["box_speed_vs_calibration"] for m in MODES}
    if max(abs(d - 1.0) for d in drift.values()) > MAX_SPEED_DRIFT:
        return f"the box's CPU speed moved during the run (fixed probe time vs calibration: {drift})"
    return None


def pooled_errors(runs: list[dict]) -> dict[str, float]:
    """Each mode's simulated over measured tok/s - 1, both summed over the runs."""
    return {m: sum(r[m]["sim_tok_s"] for r in runs) / sum(r[m]["measured_tok_s"] for r in runs) - 1.0 for m in MODES}


def table(runs: list[dict]) -> str:
    return "; ".join(f"run {i}: " + ", ".join(f"{m} {r[m]['measured_tok_s']:.0f} measured / {r[m]['sim_tok_s']:.0f} "
                                               f"simulated ({100 * r[m]['error']:+.1f}%)" for m in MODES)
                     for i, r in enumerate(runs))


def test_pooled_errors_weigh_runs_by_their_tokens_per_second():
    runs = [{m: {"sim_tok_s": 110.0, "measured_tok_s": 100.0} for m in MODES},
            {m: {"sim_tok_s": 300.0, "measured_tok_s": 200.0} for m in MODES}]
    assert pooled_errors(runs)["sync"] == pytest.approx(410 / 300 - 1)
    assert pooled_errors(runs[:1])["pool"] == pytest.approx(0.1)


def test_simulator_reproduces_the_rollout_benchmark(tmp_path):
    runs, excluded = [], []
    for seed in (0, 1):
        sim = run_benchmark(tmp_path, seed)
        why = wall_clock_problem(sim)
        if why:
            excluded.append(f"seed {seed}: {why}")
        else:
            runs.append(sim)
        if runs and all(abs(e) <= TOLERANCE for e in pooled_errors(runs).values()):
            break
    if not runs:
        pytest.skip("wall-clock comparison not meaningful: " + "; ".join(excluded))
    err = pooled_errors(runs)
    print(f"simulated vs measured tok/s, pooled over {len(runs)} run(s): "
          + ", ".join(f"{m} {100 * e:+.1f}%" for m, e in err.items()) + f" [{table(runs)}]"
          + (f"; not counted: {excluded}" if excluded else ""))
    for m, e in err.items():
        assert abs(e) <= TOLERANCE, f"{m}: simulated {100 * e:+.1f}% off the measured tok/s: {table(runs)}; not counted: {excluded}"
