"""The simulator against the measurement: calibrated on the engine in the same run, does it reproduce
`rollout_throughput.py`'s measured sync / APRIL / pool tokens/s within 15%?

    python benchmarks/simulator_check.py             # ~4-8 min on 2 cores; exit 0 within 15%, 1 outside, 2 not comparable

A small setting of `benchmarks/rollout_throughput.py --simulate` (calibration passes interleaved with its rounds).
This was a test until the suite stopped timing things (issue 25): it compares wall-clock seconds, so it only means
something when the engine had its core. On a box oversubscribed by other work (the engine thread got under 70% of
a CPU while the modes ran, read from its own CPU-time counters), or whose CPU ran more than 8% slower or faster
while a mode ran than while calibrating (a fixed CPU probe on the engines' CPU, timed around both), the wall clock
measures the neighbours, and such a run is not counted.

A short run on a shared 2-core VM has outliers that neither check sees (2 of ~10 quiet-box runs put sync at +16% /
+26% while the other runs of the same code gave -1% to +5%): when the first run misses, a second run (another
seed) is made and the verdict is on the two pooled (each mode's simulated over measured tok/s, summed over the
runs), which is what one benchmark of twice the length would measure. A simulator off by more than 15% in either
direction fails both ways. What the engine did (decode steps, rows per step) does not depend on the clock and is
checked on every run. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
logger = logging.getLogger("simulator_check")

SMALL = ["--rounds", "2", "--min-seconds", "5", "--min-steps", "2", "--no-stale-kv-modes", "--probe-seconds", "1",
         "--probe-passes", "1", "--concurrencies", "16", "64", "--c-star", "64", "--scale", "8", "--simulate"]
MODES = ("sync", "april", "pool")
MIN_CPU_SHARE = 0.7
MAX_SPEED_DRIFT = 0.08
TOLERANCE = 0.15
WORK_TOLERANCE = 0.15  # decode steps and rows per step, simulated vs measured


class NotReproduced(AssertionError):
    """The simulator's prediction or the engine's replayed work is off by more than its tolerance."""


def within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def run_benchmark(out_dir: str, seed: int) -> dict:
    """One small benchmark run; its `simulated` table after the checks that do not depend on the wall clock."""
    out = os.path.join(out_dir, f"bench-{seed}.json")
    proc = subprocess.run([sys.executable, "rollout_throughput.py", *SMALL, "--seed", str(seed), "--json-out", out],
                          cwd=HERE, capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": REPO})
    if proc.returncode != 0:
        raise RuntimeError(f"rollout_throughput.py failed (exit {proc.returncode}):\n"
                           + proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(out) as f:
        sim = json.load(f)["simulated"]
    for m in MODES:
        r = sim[m]
        if not (r["measured_tok_s"] > 0 and r["sim_tok_s"] > 0):
            raise NotReproduced(f"{m}: no tokens: {r}")
        # the simulated modes make the engine run the same decode steps with the same batch (mode logic,
        # admission, aborts, resumes), whatever the load
        if not (within(r["sim_decode_steps"], r["measured_decode_steps"], WORK_TOLERANCE)
                and within(r["sim_rows_per_step"], r["measured_rows_per_step"], WORK_TOLERANCE)):
            raise NotReproduced(f"{m}: the engine's work is not reproduced: {r}")
        if not (r["box_speed_vs_calibration"] is not None and r["box_speed_vs_calibration"] > 0):
            raise NotReproduced(f"{m}: no box-speed probe: {r}")
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


def check(out_dir: str, seeds=(0, 1)) -> dict:
    """Runs until the pooled errors are within tolerance or the seeds are spent; the verdict as a dict."""
    runs, excluded = [], []
    for seed in seeds:
        sim = run_benchmark(out_dir, seed)
        why = wall_clock_problem(sim)
        if why:
            excluded.append(f"seed {seed}: {why}")
            logger.info("seed %d not counted: %s", seed, why)
        else:
            runs.append(sim)
        if runs and all(abs(e) <= TOLERANCE for e in pooled_errors(runs).values()):
            break
    if not runs:
        return {"verdict": "not comparable", "excluded": excluded}
    err = pooled_errors(runs)
    ok = all(abs(e) <= TOLERANCE for e in err.values())
    return {"verdict": "within" if ok else "outside", "tolerance": TOLERANCE, "pooled_errors": err,
            "runs": table(runs), "excluded": excluded}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=None, help="where the benchmark's JSON goes (default: a temporary folder)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out_dir or tmp
        os.makedirs(out_dir, exist_ok=True)
        try:
            result = check(out_dir)
        except NotReproduced as e:
            result = {"verdict": "outside", "reason": str(e)}
    if "pooled_errors" in result:
        logger.info("simulated vs measured tok/s, pooled: %s [%s]",
                    ", ".join(f"{m} {100 * e:+.1f}%" for m, e in result["pooled_errors"].items()), result["runs"])
    logger.info("verdict: %s", result["verdict"])
    print(json.dumps(result))
    return {"within": 0, "outside": 1}.get(result["verdict"], 2)


if __name__ == "__main__":
    sys.exit(main())
