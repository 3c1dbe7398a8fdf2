"""Where each training step's time and memory went: one line per step of a run's metrics.jsonl.

    python tools/step_split.py RUN_DIR [--json OUT.json]

Per step (the keys of docs/metrics.md): the rollout, the engines' release, the trainer's onload, training, the
weight push (and, of it, the updater's own time, "updater": CUDA IPC handles with --update-weight-mode tensor), the
trainer's offload, the engines' resume, the rest of the step (eval, logging, checkpoints) and the whole step;
then the memory handed back each way: what the engines released and took back (their own count), what the
trainer offloaded and onloaded, and on a GPU what the device's free memory gained from each. A run that was not
colocated has no hand-overs (those columns read "-"); for train_async.py, whose rollout runs beside the trainer,
"rollout" is the time the trainer waited for its batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TIME_COLUMNS = (  # (column, metric or metrics: the first the run logged; train_async.py logs the later ones)
    ("rollout", ("perf/rollout_s", "rollout/wait_s")), ("release", "colocate/engine_release_s"),
    ("onload", "colocate/trainer_onload_s"), ("train", ("perf/train_s", "train/train_time_s")),
    ("push", ("perf/weight_push_s", "weight_sync/weight_sync_time_s")), ("updater", "weight_sync/weight_sync_time_s"),
    ("offload", "colocate/trainer_offload_s"), ("resume", "colocate/engine_resume_s"), ("step", "perf/step_time_s"))
MEMORY_COLUMNS = (
    ("engine_released", "colocate/engine_release_bytes"), ("engine_resumed", "colocate/engine_resume_bytes"),
    ("engine_device_freed", "colocate/engine_device_freed_bytes"),
    ("trainer_offloaded", "colocate/trainer_offload_bytes"), ("trainer_onloaded", "colocate/trainer_onload_bytes"),
    ("trainer_device_freed", "colocate/trainer_device_freed_bytes"), ("pushed", "weight_sync/weight_sync_bytes"))
PARTS = ("rollout", "release", "onload", "train", "push", "offload", "resume")  # "updater" is inside "push"


def step_split(records: list[dict]) -> list[dict]:
    """One dict per training step (eval-only rows, step -1, left out): seconds and bytes by column, None where the
    run did not log it; `other_s` is the step's time outside the named parts."""
    out = []
    for r in records:
        if r.get("step", -1) < 0 or "perf/step_time_s" not in r:
            continue
        row = {"step": r["step"]}
        for col, keys in TIME_COLUMNS:
            row[f"{col}_s"] = next((r[k] for k in ((keys,) if isinstance(keys, str) else keys) if k in r), None)
        for col, key in MEMORY_COLUMNS:
            row[f"{col}_bytes"] = r.get(key)
        row["other_s"] = row["step_s"] - sum(row[f"{p}_s"] or 0.0 for p in PARTS)
        out.append(row)
    return out


def _fmt(v, scale: float = 1.0, spec: str = "7.3f") -> str:
    return f"{'-':>{spec.split('.')[0]}}" if v is None else format(v / scale, spec)


def print_split(rows: list[dict], file=sys.stdout) -> None:
    cols = [c for c, _ in TIME_COLUMNS] + ["other"]
    print("seconds per step: " + " ".join(f"{c:>7s}" for c in cols) + "   | GiB: engine released / resumed / device "
          "freed; trainer offloaded / onloaded / device freed; weights pushed", file=file)
    for r in rows:
        mem = " / ".join(_fmt(r[f"{c}_bytes"], 2**30, "6.3f") for c, _ in MEMORY_COLUMNS)
        print(f"step {r['step']:4d}:       " + " ".join(_fmt(r[f"{c}_s"]) for c in cols) + f"   | {mem}", file=file)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("--json", default=None, help="also write the rows here")
    opts = p.parse_args(argv)
    path = os.path.join(opts.run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        print(f"step_split: {path} does not exist (is {opts.run_dir} a run's --run-dir?)", file=sys.stderr)
        return 2
    with open(path) as f:
        rows = step_split([json.loads(line) for line in f if line.strip()])
    if not rows:
        print(f"step_split: {path} has no training step", file=sys.stderr)
        return 1
    print_split(rows)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
