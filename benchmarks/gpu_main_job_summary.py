"""benchmarks/gpu_main_job.sh's summary: what each stage measured, and issue 42's checks.

    python benchmarks/gpu_main_job_summary.py LOGS --part 1|2 --stream-steps N --real-steps M [--cpu-dry-run]

Reads the part's files in LOGS, prints one block per stage and writes LOGS/acceptance.json: {check: bool}. On a GPU
the checks are the issue's goals (each figure says whether it met its own); a CPU dry run checks that every stage
ran and wrote what the GPU run's summary reads (CPU speeds mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SIM_LIMIT = 0.15
MFU_GOAL = 0.35
MODES = ("sync", "april", "pool")


def load(logs: str, name: str):
    try:
        with open(os.path.join(logs, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read(logs: str, name: str) -> str:
    try:
        with open(os.path.join(logs, name)) as f:
            return f.read()
    except OSError:
        return ""


def metrics(logs: str, name: str) -> list[dict]:
    rows = []
    for line in read(logs, name).splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if r.get("step", -1) >= 0 and "perf/step_time_s" in r]


def trained_per_s(rows: list[dict]) -> float | None:
    """Trained samples per second of wall time over the steps after the first (its start-up is not the rate)."""
    rows = rows[1:] if len(rows) > 1 else rows
    seconds = sum(r["perf/step_time_s"] for r in rows)
    return sum(r.get("train/num_samples", 0) for r in rows) / seconds if seconds else None


def variant(v: dict) -> str:
    mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") else v.get("error", "n/a")[:40]
    return f"{v['max_tokens_per_gpu']}: {mfu}"


WORKLOADS = ("lognormal", "pareto")


def rollout_rows(logs: str) -> list[dict]:
    """The rollout benchmark's rows: one run per workload (rollout_WORKLOAD.json), or the side-by-side table of one
    run over several (rollout_workloads.json, the job before 2026-11-29)."""
    from rollout_report import workloads_row

    rows = [workloads_row(w, r) for w in WORKLOADS if (r := load(logs, f"rollout_{w}.json"))]
    return rows or (load(logs, "rollout_workloads.json") or {}).get("rows") or []


def part1(logs: str, dry: bool, ok: dict) -> None:
    rows = rollout_rows(logs)
    for r in rows:
        st = r.get("steps") or {}
        sim = ", ".join(f"{m} {100 * r[f'sim_error_{m}']:+.1f}%" for m in MODES if f"sim_error_{m}" in r)
        cap = r.get("graph_capture_s") or {}
        print(f"E2 {r['workload']} (median {r['median']:g}, max {r['max']:g}) on {r['device_name']}: "
              + ({True: "valid", False: f"NOT VALID ({'; '.join(r.get('why_not') or [])})", None: "validity unknown"}[
                  r.get("valid")])
              + f"; x the limit sync {r['sync_over_limit']:.3f}, APRIL {r['april_over_limit']:.3f}, pool "
              f"{r['pool_over_limit']:.3f}; APRIL {r['april_over_sync']:.2f}x sync; limit "
              f"{'holds' if r.get('limit_holds') else 'EXCEEDED'}; simulator {sim or 'none'}; decode forwards "
              f"{st.get('decode_forwards')} ({st.get('graph_replayed')} replayed, {st.get('decode_ms', 0):.2f} ms each), "
              f"{st.get('mixed_forwards')} mixed, {st.get('prefill_forwards')} prefill ({st.get('prefill_ms', 0):.2f} ms "
              f"each)" + (f"; CUDA graph captures taken out: " + ", ".join(f"{k} {v:.2f}s" for k, v in cap.items())
                          if cap else ""))
        w = r["workload"]
        # (the dry run: recorded; on a GPU: every mode and the limit warmed up before it was measured)
        ok[f"E2 {w}: every mode and the limit measured after its warm-up"] = (
            r.get("valid") is not None if dry else r.get("valid") is True)
        ok[f"E2 {w}: the simulator, calibrated in the same run, predicted every mode"] = all(
            f"sim_error_{m}" in r for m in MODES)
        ok[f"E2 {w}: no forward mixed decode rows with prefill chunks"] = st.get("mixed_forwards") == 0
        # (the dry run's static graph path counts as the graphs' too; a step over --cuda-graph-max-bs rows would not)
        ok[f"E2 {w}: every decode forward went the CUDA graph's way"] = (
            st.get("decode_forwards", 0) > 0 and st.get("graph_replayed") == st.get("decode_forwards"))
        if not dry:
            ok[f"E2 {w}: no mode above the full-occupancy limit"] = bool(r.get("limit_holds"))
            ok[f"E2 {w}: simulator within 15% of every mode"] = all(
                f"sim_error_{m}" in r and abs(r[f"sim_error_{m}"]) <= SIM_LIMIT for m in MODES)
            for k, met in (r.get("targets") or {}).items():
                ok[f"E2 {w}: {k} goal"] = met
    ok["E2: rollout benchmark ran on " + ("its workloads" if dry else "both workloads")] = bool(rows) and (
        dry or {r["workload"] for r in rows} == set(WORKLOADS))
    for name, label in (("M1.json", "M1 0.5B"), ("M2.json", "M2 4B-shaped")):
        m = load(logs, name)
        done = [v for v in (m or {}).get("variants", []) if "error" not in v]
        if m is None or not done:
            print(f"{label}: no result (see its log)")
            ok[f"{label}: MFU measured"] = False
            continue
        best = min(done, key=lambda v: v["train_s"])
        prof = m.get("profile") or {}
        mfu = f"{100 * best['mfu']:.1f}%" if best.get("mfu") else "n/a"
        print(f"{label}: {m['layers']} of {m['preset_layers']} layers, {m['params'] / 1e9:.2f}B parameters on "
              f"{m['device']}; best {mfu} MFU at --max-tokens-per-gpu {best['max_tokens_per_gpu']} "
              f"({', '.join(variant(v) for v in m['variants'])})"
              + (f"; profile: GPU idle {100 * (prof.get('idle_share') or 0):.0f}%, "
                 + ", ".join(f"{k} {100 * v:.0f}%" for k, v in (prof.get("by_kind") or {}).items()) if prof else ""))
        ok[f"{label}: MFU measured"] = True
        if prof or not dry:  # (the dry run profiles M1 only)
            ok[f"{label}: profile taken"] = bool(prof.get("top"))
        if not dry:
            ok[f"{label}: MFU >= 35%"] = (best.get("mfu") or 0) >= MFU_GOAL


def part2(logs: str, stream_steps: int, real_steps: int, real_modes: list[str], dry: bool, ok: dict) -> None:
    stream = metrics(logs, "S_metrics.jsonl")
    audit = read(logs, "S_audit.txt")
    print(f"S stream: {len(stream)} steps; trained {trained_per_s(stream) or 0:.2f} samples/s; "
          + (audit.strip().splitlines() or ["no audit"])[-1])
    ok[f"S stream: >= {stream_steps} steps"] = len(stream) >= stream_steps
    ok["S stream: ledger audit clean"] = ": clean;" in audit
    rates = {"stream": trained_per_s(stream), "april": None, "sync": None}
    for mode in real_modes:
        rows = metrics(logs, f"R_{mode}_metrics.jsonl")
        rates[mode] = trained_per_s(rows)
        rewards = [r.get("reward/mean") for r in rows if r.get("reward/mean") is not None]
        evals = [r for r in rows if any(k.startswith("eval/") and k.endswith("/accuracy") for k in r)]
        tail = sum(rewards[-5:]) / len(rewards[-5:]) if rewards else float("nan")
        print(f"R {mode}: {len(rows)} steps, {sum(r['perf/step_time_s'] for r in rows):.1f} s, trained "
              f"{rates[mode] or 0:.2f} samples/s; reward first {rewards[0] if rewards else float('nan'):.3f}, mean of "
              f"the last 5 {tail:.3f}" + (f"; eval accuracy {[round(next(v for k, v in e.items() if k.endswith('/accuracy')), 3) for e in evals]}" if evals else ""))
        ok[f"R {mode}: >= {real_steps} steps"] = len(rows) >= real_steps
    if rates["stream"] and rates["april"]:
        print(f"stream / train.py APRIL, trained samples/s on the same workload: {rates['stream'] / rates['april']:.2f}x")
    if rates["april"] and rates["sync"]:
        print(f"APRIL / sync, trained samples/s: {rates['april'] / rates['sync']:.2f}x")
    push = load(logs, "weight_push.json")
    if push:
        print(f"W weight push: {push['bytes'] / 1e9:.2f} GB ({push['layers']} layers) on {push['device']} in "
              f"{push['push_s']:.3f} s ({push['gb_per_s']:.1f} GB/s); goal <= 0.2 s for 8 GB: "
              f"{'met' if push['goal_met'] else 'NOT met'}")
    ok["W: weight push timed"] = push is not None
    if push and not dry:
        ok["W: ~8 GB pushed in <= 0.2 s"] = bool(push["goal_met"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("logs")
    p.add_argument("--part", choices=["1", "2"], required=True)
    p.add_argument("--stream-steps", type=int, default=0)
    p.add_argument("--real-steps", type=int, default=0)
    p.add_argument("--real-modes", nargs="*", default=["april", "sync"])
    p.add_argument("--cpu-dry-run", action="store_true")
    o = p.parse_args(argv)
    ok: dict[str, bool] = {}
    print(read(o.logs, "env.txt").rstrip())
    print(read(o.logs, "status.txt").rstrip())
    if o.part == "1":
        part1(o.logs, o.cpu_dry_run, ok)
    else:
        part2(o.logs, o.stream_steps, o.real_steps, o.real_modes, o.cpu_dry_run, ok)
    print("acceptance" + (" (CPU dry run: the stages ran; speeds are the GPU's to judge)" if o.cpu_dry_run else "")
          + ": " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in ok.items()))
    with open(os.path.join(o.logs, "acceptance.json"), "w") as f:
        json.dump(ok, f, indent=1)
    return 0 if ok and all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
