"""benchmarks/gpu_main_job.sh's summary: what each stage measured, and the issue's acceptance checks.

    python benchmarks/gpu_main_job_summary.py OUT_DIR --part engine|train --steps N --stream-steps M [--cpu-dry-run]

Reads the part's files in OUT_DIR, prints one block per stage and writes OUT_DIR/acceptance_PART.json:
{check: bool}.
On a GPU the checks are the issue's (the graphs' step at 1 row <= at 128, greedy tokens unchanged, the simulator
within 15% per mode and workload, >= N colocated steps each with its weight push and memory hand-back, the ledger
audits clean); a CPU dry run checks that every stage ran and wrote what the GPU run's summary reads (CPU speeds
mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SIM_LIMIT = 0.15


def load(out: str, name: str):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read(out: str, name: str) -> str:
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return ""


def engine_part(out: str, dry: bool, ok: dict) -> None:
    eager, graphs = load(out, "step_off.json"), load(out, "step_static.json" if dry else "step_auto.json")
    for name, s in (("eager", eager), ("CUDA graphs", graphs)):
        if s is None:
            print(f"decode step ({name}): missing (see E1_step_*.log)")
            continue
        rows = sorted(s["step_ms"], key=int)
        print(f"decode step, {s['model']} on {s['device_name']} ({s['dtype']}), graphs {s.get('cuda_graph_mode')}: "
              + ", ".join(f"{r} rows {s['step_ms'][r]:.2f} ms (issued {s['launch_ms'][r]:.2f})" for r in rows))
    ok["E1: decode step measured eager and with graphs"] = eager is not None and graphs is not None
    if eager is not None and graphs is not None:
        rows = sorted(graphs["step_ms"], key=int)
        same = graphs["greedy_tokens"] == eager["greedy_tokens"]
        same_batch = sum(a == b for a, b in zip(graphs["greedy_batch_tokens"], eager["greedy_batch_tokens"]))
        print(f"greedy tokens with graphs: one prompt {'unchanged' if same else 'CHANGED'}; {same_batch} of "
              f"{len(eager['greedy_batch_tokens'])} prompts sent together unchanged")
        ok["E1: greedy tokens unchanged with graphs"] = same and same_batch == len(eager["greedy_batch_tokens"])
        if not dry:
            ok["E1: decode steps replayed CUDA graphs"] = graphs.get("cuda_graph_mode") == "capture"
            ok[f"E1: graphs' step at {rows[0]} row <= at {rows[-1]} rows"] = (
                graphs["step_ms"][rows[0]] <= graphs["step_ms"][rows[-1]])
    wl = load(out, "rollout_workloads.json")
    rows = (wl or {}).get("rows") or []
    for r in rows:
        sim = ", ".join(f"{m} {100 * r[f'sim_error_{m}']:+.1f}%" for m in ("sync", "april", "pool") if f"sim_error_{m}" in r)
        print(f"rollout, {r['workload']} (median {r['median']:g}, max {r['max']:g}, {r['max_over_median']}x) on "
              f"{r['device_name']}: x the limit sync {r['sync_over_limit']:.3f}, APRIL {r['april_over_limit']:.3f}, "
              f"pool {r['pool_over_limit']:.3f}; APRIL {r['april_over_sync']:.2f}x sync; simulator: {sim or 'none'}")
        ok[f"E2 {r['workload']}: the simulator, calibrated in the same run, predicted every mode"] = all(
            f"sim_error_{m}" in r for m in ("sync", "april", "pool"))
        if not dry:
            ok[f"E2 {r['workload']}: simulator within 15% of every mode"] = all(
                f"sim_error_{m}" in r and abs(r[f"sim_error_{m}"]) <= SIM_LIMIT for m in ("sync", "april", "pool"))
    ok["E2: rollout benchmark ran on both workloads"] = {r["workload"] for r in rows} == {"pareto", "lognormal"}


def train_part(out: str, steps: int, stream_steps: int, ok: dict) -> None:
    task = read(out, "task.json").strip()
    if task:
        print(f"main job task: {json.loads(task)['workload']}")
    for name, label, steps in (("main_job", "T1 main job (colocated)", steps),
                               ("stream", "T2 stream (disaggregated)", stream_steps)):
        split = load(out, f"{name}_split.json") or []
        audit = read(out, f"{name}_audit.txt")
        print(f"{label}: {len(split)} steps logged; " + (audit.strip().splitlines() or ["no audit"])[-1])
        if split:
            print(read(out, f"{name}_split.txt").rstrip())
        ok[f"{label}: >= {steps} steps"] = len(split) >= steps
        ok[f"{label}: ledger audit clean"] = ": clean;" in audit
        if name == "main_job":
            graphs = read(out, "main_job_graphs.txt").strip()
            print("  the engine's last release: " + (graphs.split(": ", 1)[-1] if graphs else "not in its log"))
            ok[f"{label}: weight push and memory hand-back in every step"] = bool(split) and all(
                r["updater_s"] is not None and r["engine_released_bytes"] is not None
                and r["trainer_offloaded_bytes"] is not None for r in split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--part", choices=["engine", "train"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--stream-steps", type=int, required=True)
    p.add_argument("--cpu-dry-run", action="store_true")
    opts = p.parse_args(argv)
    ok: dict[str, bool] = {}
    print(read(opts.out, f"status_{opts.part}.txt").rstrip())
    if opts.part == "engine":
        engine_part(opts.out, opts.cpu_dry_run, ok)
    else:
        train_part(opts.out, opts.steps, opts.stream_steps, ok)
    print("acceptance" + (" (CPU dry run: the stages ran; speeds are the GPU's to judge)" if opts.cpu_dry_run else "")
          + ": " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in ok.items()))
    with open(os.path.join(opts.out, f"acceptance_{opts.part}.json"), "w") as f:
        json.dump(ok, f, indent=1)
    return 0 if ok and all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
