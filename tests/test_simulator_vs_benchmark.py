"""Acceptance: the simulator, calibrated on the engine in the same run, reproduces the rollout
benchmark's measured sync / APRIL / pool tokens/s within 15% (a small setting of
benchmarks/rollout_throughput.py with --simulate: calibration passes interleaved with its rounds).

The comparison is in wall-clock seconds, so it only means something when the engine had its core:
on a box oversubscribed by other work (the engine thread got under 70% of a CPU while the modes
ran, read from its own CPU-time counters), or whose CPU ran more than 8% slower or faster while a mode
ran than while calibrating (a fixed CPU probe on the engines' CPU, timed around both), the wall clock
measures the neighbours, and the test is skipped with the numbers instead of asserting on noise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SMALL = ["--rounds", "2", "--min-seconds", "5", "--min-steps", "2", "--no-stale-kv-modes", "--probe-seconds", "1",
         "--probe-passes", "1", "--concurrencies", "16", "64", "--c-star", "64", "--scale", "8", "--simulate"]
MIN_CPU_SHARE = 0.7
MAX_SPEED_DRIFT = 0.08
TOLERANCE = 0.15


def test_simulator_reproduces_the_rollout_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "rollout_throughput.py", *SMALL, "--json-out", str(out)],
                          cwd=os.path.join(REPO, "benchmarks"), capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sim = json.loads(out.read_text())["simulated"]
    table = {m: (sim[m]["measured_tok_s"], sim[m]["sim_tok_s"], sim[m]["error"], sim[m].get("engine_cpu_share"))
             for m in ("sync", "april", "pool")}
    for m, (measured, simulated, _, _) in table.items():
        assert measured > 0 and simulated > 0, table
    # what the engine did does not depend on the wall clock: the simulated modes make the engine run the same
    # number of decode steps with the same batch (mode logic, admission, aborts, resumes), whatever the load
    for m in table:
        r = sim[m]
        assert r["sim_decode_steps"] == pytest.approx(r["measured_decode_steps"], rel=0.15), (m, r)
        assert r["sim_rows_per_step"] == pytest.approx(r["measured_rows_per_step"], rel=0.15), (m, r)
    shares = [s for *_, s in table.values() if s is not None]
    if shares and min(shares) < MIN_CPU_SHARE:
        pytest.skip(f"box oversubscribed (engine CPU share {min(shares):.2f} < {MIN_CPU_SHARE}): wall-clock comparison "
                    f"not meaningful; measured vs simulated: {table}")
    # a shared host can slow this VM's CPU for tens of seconds with nothing showing inside it: a fixed CPU probe on
    # the engines' CPU, timed around the calibration and around each mode, says whether the box ran at one speed
    drift = {m: sim[m]["box_speed_vs_calibration"] for m in table}
    assert all(d is not None and d > 0 for d in drift.values()), drift
    if max(abs(d - 1.0) for d in drift.values()) > MAX_SPEED_DRIFT:
        pytest.skip(f"the box's CPU speed moved during the run (fixed probe time vs calibration: {drift}): wall-clock "
                    f"comparison not meaningful; measured vs simulated: {table}")
    for m, (measured, simulated, err, _) in table.items():
        assert abs(err) <= TOLERANCE, f"{m}: measured {measured:.0f} tok/s, simulated {simulated:.0f} ({100 * err:+.1f}%): {table}"
