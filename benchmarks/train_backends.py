"""The quick start with each trainer backend, same run length: does Megatron
learn like FSDP, and what does a step cost?

Runs `scripts/quickstart.sh` (APRIL, the cached warm start in runs/tiny) once
per backend, one after the other on the same box and seed, with eval at the
start and at the end, then prints per backend: trainer time per step
(`train/train_time_s`: old log-probs + optimizer steps), weight-sync time per
step, wall time per step, and eval accuracy first -> last; the ratios
Megatron / FSDP; the last line is one JSON.

    python benchmarks/train_backends.py [--steps 40] [--backends fsdp megatron] [-- extra train.py flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(backend: str, steps: int, root: str, extra: list[str]) -> dict:
    run_dir = os.path.join(root, backend)
    # SIMULATE=0: the quick start's closing engine calibration (for the plots' simulator) is not a backend's time
    env = {**os.environ, "RUN": run_dir, "STEPS": str(steps), "EVAL_INTERVAL": str(steps), "PYTHONUNBUFFERED": "1",
           "SLIME_SKIP_INSTALL": "1", "SIMULATE": "0"}
    t0 = time.perf_counter()
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "quickstart.sh"), "--train-backend", backend, *extra],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{backend}: quickstart failed\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps_rows = [r for r in rows if r["step"] >= 0 and "train/train_time_s" in r]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))

    def per_step(key: str) -> float:
        values = [r[key] for r in steps_rows if key in r]
        return statistics.mean(values) if values else float("nan")

    return {
        "backend": backend,
        "steps": len(steps_rows),
        "train_s_per_step": per_step("train/train_time_s"),
        "train_s_per_step_median": statistics.median(r["train/train_time_s"] for r in steps_rows),
        "weight_sync_s_per_step": per_step("weight_sync/weight_sync_time_s"),
        "wall_s_per_step": wall / max(1, len(steps_rows)),
        "eval_accuracy_first": summary.get("eval_accuracy_first"),
        "eval_accuracy_last": summary.get("eval_accuracy_last"),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--backends", nargs="+", default=["fsdp", "megatron"])
    p.add_argument("--keep", default=None, help="keep the runs under this directory (default: a temp dir)")
    a, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    root = a.keep or tempfile.mkdtemp(prefix="train_backends_")
    results = [run(b, a.steps, root, extra) for b in a.backends]
    print(f"{'backend':<10}{'steps':>6}{'train s/step':>14}{'(median)':>10}{'sync s/step':>13}{'wall s/step':>13}"
          f"{'eval first -> last':>22}")
    for r in results:
        print(f"{r['backend']:<10}{r['steps']:>6}{r['train_s_per_step']:>14.3f}{r['train_s_per_step_median']:>10.3f}"
              f"{r['weight_sync_s_per_step']:>13.3f}{r['wall_s_per_step']:>13.2f}"
              f"{r['eval_accuracy_first']:>12.3f} -> {r['eval_accuracy_last']:.3f}")
    by = {r["backend"]: r for r in results}
    if "fsdp" in by and "megatron" in by:
        for key in ("train_s_per_step", "weight_sync_s_per_step", "wall_s_per_step"):
            print(f"megatron / fsdp {key}: {by['megatron'][key] / by['fsdp'][key]:.2f}x")
    print(json.dumps({"runs": results, "dir": root}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
