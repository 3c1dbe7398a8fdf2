"""The rollout benchmark on both workloads, one after the other, and their ratios side by side.

    python benchmarks/rollout_workloads.py [--workloads pareto lognormal] [--json-out FILE] -- ARGS...

Runs `rollout_throughput.py --workload W ARGS...` for each workload (each measures its modes interleaved with
the full-occupancy limit, so every ratio below is taken within one run), then prints per workload: the budgets'
shape (median, max / median), APRIL, pool and sync over the limit, APRIL over sync and, with `--simulate`, the
simulator's error per mode; and the box (device, CPUs, load). `pareto` is the heavy tail (max / median 21-43x)
where synchronous rollout loses the most; `lognormal` is the APRIL paper's setting as tools/simulate_rollout.py
assumes it (max / median ~2.7x). A figure quoted from here names its workload and its box.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from rollout_workload import WORKLOADS

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("sync", "april", "pool")


def box() -> dict:
    return {"host_cpus": os.cpu_count(), "python": platform.python_version(), "load_1min": round(os.getloadavg()[0], 2)}


def row(name: str, r: dict) -> dict:
    wl, sim = r.get("workload") or {}, r.get("simulated") or {}
    return {"workload": name, "lengths": wl.get("lengths"), "median": wl.get("median"), "max": wl.get("max"),
            "max_over_median": wl.get("max_over_median"), "device": r["engine"]["device"],
            "device_name": r["engine"]["device_name"], "dtype": r["engine"]["dtype"], "c_star": r["c_star"],
            "rounds": r["rounds"], "limit_tok_s": r["limit_tok_s"],
            **{f"{m}_over_limit": r[f"{m}_over_limit"] for m in MODES},
            "april_over_sync": r["april_over_sync"], "pool_over_sync": r["pool_over_sync"],
            **{f"sim_error_{m}": sim[m]["error"] for m in MODES if m in sim}}


def print_table(rows: list[dict], boxes: list[dict]) -> None:
    print("\nworkload    budgets (median / max, max/median)   x limit: sync  APRIL   pool | APRIL/sync | simulator "
          "error sync / APRIL / pool | device, C*, rounds")
    for r, b in zip(rows, boxes):
        sim = " / ".join(f"{100 * r[f'sim_error_{m}']:+.0f}%" if f"sim_error_{m}" in r else "-" for m in MODES)
        print(f"{r['workload']:10s}  {r['median']:>5g} / {r['max']:>5g} ({r['max_over_median']:>5.1f}x)"
              f"             {r['sync_over_limit']:5.3f} {r['april_over_limit']:6.3f} {r['pool_over_limit']:6.3f} |"
              f" {r['april_over_sync']:9.2f}x | {sim:>26s} | {r['device_name']} ({r['dtype']}), C* {r['c_star']}, "
              f"{r['rounds']} round(s); {b['host_cpus']} CPUs, load {b['load_1min']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None, help="each run's output here (default: a temporary directory)")
    opts = p.parse_args(ours)
    if any(a == "--workload" or a.startswith("--workload=") or a == "--json-out" for a in rest):
        p.error("--workload and --json-out are set per run by this script; give --workloads / --json-out before --")
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="rollout_workloads_")
    os.makedirs(log_dir, exist_ok=True)
    rows, boxes, failed = [], [], []
    for name in opts.workloads:
        out_json = os.path.join(log_dir, f"rollout_{name}.json")
        log = os.path.join(log_dir, f"rollout_{name}.log")
        t0 = time.monotonic()
        print(f"=== {name}: rollout_throughput.py --workload {name} {' '.join(rest)} (log: {log})", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run([sys.executable, os.path.join(HERE, "rollout_throughput.py"), "--workload", name,
                                 "--json-out", out_json, *rest], stdout=f, stderr=subprocess.STDOUT).returncode
        boxes.append(box())
        if rc != 0 or not os.path.isfile(out_json):
            print(f"{name}: rollout_throughput.py exited {rc} after {time.monotonic() - t0:.0f}s; see {log}", flush=True)
            failed.append(name)
            continue
        with open(out_json) as f:
            rows.append(row(name, json.load(f)))
        print(f"{name}: done in {time.monotonic() - t0:.0f}s", flush=True)
    boxes = [b for b, name in zip(boxes, opts.workloads) if name not in failed]
    if rows:
        print_table(rows, boxes)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"rows": rows, "boxes": boxes, "failed": failed, "args": rest}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
