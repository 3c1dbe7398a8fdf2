"""Rollout throughput: synchronous vs APRIL vs pool mode vs the engine's limit, with its spread.

1. Probes the embedded engine's decode throughput at several concurrencies (C requests always in flight) and picks
   C*, the smallest C within 5% of the best.
2. Workload (`--workload`, rollout_workload.py): ignore_eos; `pareto` (default): each sample's budget `--scale` x q
   tokens, q from the subtract_chain task's truncated Pareto (max / median 21-43x); `lognormal`: the APRIL paper's
   setting as `tools/simulate_rollout.py paper` assumes it, scaled to the same cap (max / median ~2.7x). Given
   several, each runs in a process of its own and their ratios are printed side by side (`--json-out`: all rows).
3. Modes, each with its own data source (same seed), buffer and policy version: sync (B = C*/n groups), APRIL
   (partial, over-sampling 2B, at most C* in flight), pool (C* in flight), and april_kv / pool_kv (the same with
   --reuse-stale-kv, on an engine of their own that nothing flushes). Before every step a simulated weight update
   bumps the engine's weight_version and flushes its cache (not for the _kv modes), so every parked sample is
   re-prefilled when it resumes: on this CPU a good fraction of decoding it, on a GPU ~1/100.
4. The limit: C* requests in flight the whole time on a second engine (same command and pinning), measured in
   slices of one steady state: an upper bound (no re-prefill, no ramp, no drain).
5. Warm-up: each partial mode and the limit run unmeasured for --warmup-steps engine steps, so that all are
   measured in the long tail's steady state.
6. Noise control: engines pinned to --engine-cpus, this driver and the routers to --driver-cpus; every mode step
   is followed by a limit slice as long as the step, so each ratio compares measurements seconds apart; rounds go
   on until APRIL/limit's 90% interval is within --target-spread after --min-rounds, at most --rounds.
7. Prints per mode: tok/s, the ratio to the limit (mean +- 90% half-width, std) and to sync, per-round ratios,
   the off-policy token ratio, a per-step breakdown and the engine's cost fit; the last line is one JSON.
8. With --simulate, calibrates the modes' engine between rounds and prints the rollout simulator's prediction of
   every mode beside its measurement (rollout_simcheck.py).
9. On a GPU only the engines' device changes (no Ray needed, only sglang-router); `--model-preset qwen3-0.5b`
   makes the step cost realistic there (benchmarks/gpu_check.sh runs it).

    python benchmarks/rollout_throughput.py [--rounds 8] [--min-seconds 6] [--cap 128] [--scale 24] [--simulate]
        [--workload pareto lognormal] [--model-preset qwen3-0.5b] [--time-budget SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import requests
from rollout_host import Clock, box_speed, pin_processes
from rollout_report import gpu_acceptance, print_workloads_table, report, spread, validity, workloads_row
from rollout_simcheck import make_calibrator, predict
from rollout_workload import (WORKLOADS, BudgetSource, LimitRunner, ModeRunner, build_bench_model, constant_load,
                              workload_lengths, workload_summary)

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.gc_utils import freeze_gc_heap
from slime.utils.tiny_model import build_preset, build_tokenizer, model_preset

logger = logging.getLogger("rollout_throughput")


async def main_async(opts, workdir):
    tok = build_tokenizer(VOCAB)
    if opts.model_preset:
        spec = model_preset(opts.model_preset)
        if opts.scale * opts.cap + 64 > spec.max_position_embeddings:
            raise SystemExit(f"--scale x --cap = {opts.scale * opts.cap} tokens do not fit the {opts.model_preset} "
                             f"preset's context ({spec.max_position_embeddings})")
        model_dir = build_preset(opts.model_preset, opts.model_cache or workdir, tok)
    else:
        model_dir, spec = build_bench_model(opts, workdir, tok)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)  # only to satisfy --prompt-data
    base = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1", "--rollout-backend", "embedded",
            "--n-samples-per-prompt", str(opts.n), "--rollout-max-response-len", str(opts.scale * opts.cap),
            "--rollout-seed", str(opts.seed), "--run-dir", os.path.join(workdir, "run"),
            "--sglang-step-composition", opts.step_composition, "--sglang-cuda-graph-mode", opts.cuda_graph_mode]
    probe = parse_args(base + ["--rollout-batch-size", "1"]).replace(rollout_ignore_eos=True)
    vocab = len(tok)
    lengths = workload_lengths(opts.workload, opts.scale, opts.cap)
    workload = workload_summary(opts.workload, lengths, opts.seed, opts.n)
    print(f"workload {opts.workload} ({workload['lengths']}): budget tokens " + ", ".join(
        f"{k} {workload[k]}" for k in ("median", "mean", "p90", "max", "max_over_median"))
        + f"; model {opts.model_preset or 'tiny'}: hidden {spec.hidden_size} x {spec.num_hidden_layers} layers", flush=True)
    clock = Clock(opts.time_budget)
    # Engine groups with the same command and pinning: the modes' and the limit's. The limit never sees the
    # modes' cache flushes, so its in-flight samples continue on their KV from one slice to the next (an
    # honest upper bound); on one engine every slice would start by re-prefilling them.
    # A third for the --reuse-stale-kv modes, whose parked samples' KV the other modes' flushes would drop.
    names = ["modes", "limit"] + ([] if opts.no_stale_kv_modes else ["kv"])
    with engine_groups(probe, workdir, names) as groups:
        engines, limit_engines, kv_engines = groups["modes"], groups["limit"], groups.get("kv")
        device = engine_device(engines)
        pinning = pin_processes(list(groups.values()), opts.engine_cpus, opts.driver_cpus,
                                separate=device["device"] != "cpu")
        print(f"pinning: {pinning}; engines on {device['device']} ({device['device_name']}, {device['dtype']}); "
              f"engines ready {clock.elapsed():.0f}s after the start", flush=True)
        # one HTTP session for every mode and the limit: connections to the routers stay open across steps
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(opts.concurrencies) + 64)) as http:
            # (1) throughput curve (on the limit's engine)
            curve = {}
            await constant_load(probe, limit_engines, http, max(opts.concurrencies), 2.0, BudgetSource(lengths, 2, 1, vocab))  # warm-up
            for p in range(opts.probe_passes):  # best of a few passes: a busy moment of the box must not pick C*
                for c in opts.concurrencies:
                    v = await constant_load(probe, limit_engines, http, c, opts.probe_seconds, BudgetSource(lengths, 1 + p, 1, vocab))
                    curve[c] = max(curve.get(c, 0.0), v)
            for c in opts.concurrencies:
                print(f"concurrency {c:4d}: {curve[c]:8.1f} tok/s   ms per decode step ~ {1000 * c / curve[c]:7.2f}", flush=True)
            best = max(curve.values())
            c_star = opts.c_star or min(c for c, v in curve.items() if v >= 0.95 * best)  # smallest C within 5% of best
            c_star = max(opts.n, c_star - c_star % opts.n)
            if c_star not in curve:
                curve[c_star] = await constant_load(probe, limit_engines, http, c_star, opts.probe_seconds,
                                                    BudgetSource(lengths, 1, 1, vocab))
            b = c_star // opts.n
            print(f"C* = {c_star} (B = {b} groups x n = {opts.n}); step time at C* is "
                  f"{(c_star / curve[c_star]) / (min(curve) / curve[min(curve)]):.2f}x the step time at C={min(curve)}",
                  flush=True)

            def mode_args(*extra):
                return parse_args(base + ["--rollout-batch-size", str(b), "--sglang-server-concurrency", str(c_star),
                                          *extra]).replace(rollout_ignore_eos=True)

            def source():  # every mode's fresh groups: the same budgets in the same order
                return BudgetSource(lengths, opts.seed, opts.n, vocab)

            runners = {
                "sync": ModeRunner("sync", mode_args(), engines, http, source()),
                "april": ModeRunner("april", mode_args("--partial-rollout", "--over-sampling-batch-size",
                                                      str(opts.april_over_sampling * b)), engines, http, source()),
                "pool": ModeRunner("pool", mode_args("--partial-rollout", "--rollout-mode", "pool",
                                                     "--rollout-pool-size", str(c_star)), engines, http, source()),
            }
            if kv_engines is not None:  # the same two modes resuming on the KV they had (no re-prefill)
                for k in ("april", "pool"):
                    runners[k + "_kv"] = ModeRunner(k + "_kv", runners[k].args.replace(reuse_stale_kv=True), kv_engines,
                                                    http, source())
            limit = LimitRunner(probe, limit_engines, http, c_star, BudgetSource(lengths, opts.seed, 1, vocab))
            # One sync step first, not measured: what a sync step takes plans the rounds (C* / the probe's tok/s is
            # no decode step where each admitted request costs a prefill forward of its own), and on a GPU the
            # small batches of its tail capture their CUDA graphs here, not in a measured step.
            await runners["sync"].warm_up(1)
            # What the rest costs: a round, the calibration and the report; the warm-up gets what --time-budget
            # leaves beyond them.
            plan = clock.plan(opts, step_s=c_star / curve[c_star], modes=list(runners),
                              warm_runs=sum(1 for r in runners.values() if r.args.partial_rollout) + 1,
                              sync_s=runners["sync"].warm_step_s)
            print(plan.describe(), flush=True)
            # Warm-up, not measured: the long tail takes a while to reach its steady state (the longest
            # sample needs as many decode steps as its budget), in the limit's carry as in each partial mode's
            # buffer; until then contexts are shorter and steps cheaper, and a mode or the limit measured
            # earlier in its own warm-up than the other would look better than it is.
            warm_steps = opts.scale * opts.cap if opts.warmup_steps is None else opts.warmup_steps
            t_warm = time.monotonic()
            warm = {k: await r.warm_up(warm_steps, plan.warmup_s) for k, r in runners.items() if r.args.partial_rollout}
            limit_ran = await limit.warm_up(warm_steps, plan.warmup_s)
            steady = {**{k: e >= warm_steps for k, (_, e) in warm.items()}, "limit": limit_ran >= warm_steps}
            print(f"warm-up: {time.monotonic() - t_warm:.0f}s, until {warm_steps} engine steps"
                  + (f" or {plan.warmup_s:.1f}s" if plan.warmup_s is not None else "") + " per partial mode and the limit: "
                  + ", ".join(f"{k} {n} rollout steps ({e} engine steps)" for k, (n, e) in warm.items())
                  + f", limit {limit_ran} engine steps", flush=True)
            plan.measured(runners)
            print(f"plan after the warm-up: a round ~{plan.round_s:.0f}s ("
                  + ", ".join(f"{k} ~{v:.0f}s" for k, v in plan.mode_s.items()) + f"); {clock.left():.0f}s left",
                  flush=True)
            freeze_gc_heap("rollout benchmark")  # as the RolloutManager does once started: no full-heap GC stalls
            ratios: dict[str, list[float]] = {k: [] for k in runners}
            loads = [os.getloadavg()[0]]
            cal = make_calibrator(engines, vocab, mode_args(), quick=opts.calibration == "quick",
                                  max_context=opts.scale * opts.cap + 8, new_tokens=opts.calibration_new_tokens) \
                if opts.simulate else None
            speed: dict[str, list[float]] = {}  # --simulate: the box's speed on the engines' CPU (box_speed)
            cal_pass_s, cal_complete = 0.0, []
            if cal is not None:
                cal_pass_s = await calibrate_pass(cal, http, speed, pinning, plan.calibration_deadline(first=True),
                                                  cal_complete)
            # Every mode step is followed by a slice of the limit as long as the step (within
            # [--limit-min-seconds, --limit-seconds]), and a mode's ratio in a round is its tok/s over the
            # limit's in the slices paired with its steps: both sides are measured seconds apart, so the
            # load of a shared box hits them alike. Rounds go on until APRIL/limit's 90% interval is within
            # --target-spread (after --min-rounds, at most --rounds), or --time-budget has no room for another.
            for r in range(opts.rounds):
                t_round = time.monotonic()
                for i, (k, runner) in enumerate(runners.items()):
                    paired = []

                    async def after_step(dt, paired=paired):
                        d = min(max(dt, opts.limit_min_seconds), opts.limit_seconds)
                        paired.append((await limit.slice(d), d))

                    if cal is not None:
                        speed.setdefault(k, []).append(await box_speed(pinning))
                    await runner.run_for(opts.min_seconds, opts.min_steps, after_step,
                                         plan.mode_deadline(k, list(runners)[i + 1:]))
                    if cal is not None:
                        speed[k].append(await box_speed(pinning))
                    lim = sum(t * d for t, d in paired) / sum(d for _, d in paired)
                    if lim <= 0:  # the limit's engine generated nothing in its slices (a stalled driver on a busy box)
                        lim = limit.tok_s
                        print(f"round {r}, {k}: its paired limit slices saw no tokens; compared with the limit's mean "
                              f"over every slice ({lim:.0f} tok/s)", flush=True)
                    ratios[k].append(runner.rounds[-1] / lim)
                    loads.append(os.getloadavg()[0])
                round_s = time.monotonic() - t_round
                print(f"round {r}: " + "  ".join(f"{k} {v.rounds[-1]:.0f} ({ratios[k][-1]:.3f}x limit)"
                                                 for k, v in runners.items())
                      + f"; load {loads[-1]:.1f}; {round_s:.0f}s", flush=True)
                if cal is not None and plan.room_for(cal_pass_s, "another calibration pass"):
                    cal_pass_s = await calibrate_pass(cal, http, speed, pinning, plan.calibration_deadline(first=False),
                                                      cal_complete)
                if r + 1 >= opts.min_rounds and spread(ratios["april"])["ci90"] <= opts.target_spread:
                    break
                if r + 1 < opts.rounds and not plan.room_for(round_s + cal_pass_s, "another round"):
                    break
    res = {k: v.result() for k, v in runners.items()}
    summary = report(res, ratios, limit, c_star, curve, loads, pinning, opts, clock.t_start)
    summary["engine"] = device
    summary["workload"] = workload
    summary["time_budget"] = plan.to_dict()
    summary["validity"] = validity(warm_steps, steady, cal_complete if cal is not None else None, res, limit)
    # what each engine did over the measured steps (busy, idle, steps, rows, prefill): where a mode's time went
    summary["engine_counters"] = {**{k: r["engine"] for k, r in res.items()}, "limit": dict(limit.engine)}
    if cal is not None:
        try:
            summary["simulated"] = predict(runners, res, cal, opts, vocab, b, c_star, speed,
                                           on_gpu=device["device"] != "cpu")
        except (RuntimeError, ValueError, ZeroDivisionError) as e:  # e.g. a calibration cut before its probes ran
            print(f"simulator: no prediction ({type(e).__name__}: {e}); the measurement stands alone", flush=True)
            summary["simulated"] = None
    summary["gpu_acceptance"] = gpu_acceptance(summary)
    print(json.dumps(summary))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    print(f"rollout benchmark done in {clock.elapsed():.0f}s" + (f" (--time-budget {opts.time_budget:.0f}s)"
                                                                 if opts.time_budget else ""), flush=True)


@contextlib.contextmanager
def engine_groups(args, workdir: str, names: list[str]):
    """Engine groups (one engine behind its router each) started side by side; all shut down on the way out."""
    groups = {name: EngineGroup(args, log_dir=os.path.join(workdir, f"{name}_logs")) for name in names}
    # The threads that start the groups live until the groups are shut down: a router is launched by the thread
    # that starts its group and dies with that thread (PR_SET_PDEATHSIG, process_utils.ManagedProcess).
    pool = ThreadPoolExecutor(len(groups), thread_name_prefix="engine-groups")
    try:
        for fut in [pool.submit(g.start) for g in groups.values()]:
            fut.result()
        yield groups
    finally:
        for fut in [pool.submit(g.shutdown) for g in groups.values()]:
            fut.result()
        pool.shutdown()


def engine_device(engines) -> dict:
    """Where the modes' engine runs (its /get_server_info): device, its name, dtype."""
    info = requests.get(engines.worker_urls()[0] + "/get_server_info", timeout=30).json()
    return {"device": info.get("device", "cpu"), "device_name": info.get("device_name", "cpu"), "dtype": info.get("dtype")}


async def calibrate_pass(cal, http, speed: dict, pinning: dict, deadline: float | None = None,
                         complete_passes: list | None = None) -> float:
    """One calibration pass (nothing new started after `deadline`), with the box's speed on the engines' CPU timed
    before and after it; returns its seconds (and appends whether it was complete to `complete_passes`)."""
    t0 = time.monotonic()
    speed.setdefault("calibration", []).append(await box_speed(pinning))
    complete = await cal.measure(http, deadline=deadline)
    if complete_passes is not None:
        complete_passes.append(complete)
    speed["calibration"].append(await box_speed(pinning))
    took = time.monotonic() - t0
    print(f"calibration pass {'done' if complete else 'cut short (see the warning above)'} in {took:.1f}s", flush=True)
    return took


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="at most this many rounds (each: every mode in turn)")
    p.add_argument("--min-rounds", type=int, default=4, help="at least this many rounds")
    p.add_argument("--target-spread", type=float, default=0.05,
                   help="stop after --min-rounds once APRIL/limit's 90%% interval half-width is at most this")
    p.add_argument("--min-seconds", type=float, default=6.0, help="rollout time of each mode in each round")
    p.add_argument("--min-steps", type=int, default=2, help="at least this many steps per mode per round")
    p.add_argument("--limit-seconds", type=float, default=4.0, help="longest limit slice (one after each mode step)")
    p.add_argument("--limit-min-seconds", type=float, default=1.0, help="shortest limit slice")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="engine steps each partial mode and the limit run first, unmeasured, to reach the long "
                        "tail's steady state (default: the longest budget, --scale x --cap)")
    p.add_argument("--engine-cpus", default=None,
                   help="CPUs for the engines, e.g. '1' (default: the last CPU; on a GPU up to 3 CPUs per engine)")
    p.add_argument("--driver-cpus", default=None, help="CPUs for this driver and the routers (default: the others)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt group")
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=["pareto"],
                   help="budgets: pareto (long tail, max/median 21-43x) or lognormal (the APRIL paper's shape, ~2.7x); "
                        "several: one run each, their ratios side by side")
    p.add_argument("--cap", type=int, default=128, help="the longest budget is --scale x --cap tokens (pareto: the cap "
                                                         "on chain steps q, budget scale x q)")
    p.add_argument("--scale", type=int, default=24,
                   help="tokens per chain step: a sample's budget is scale x q (24: median 72, max 3072)")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[4, 16, 32, 64, 96, 128])
    p.add_argument("--probe-seconds", type=float, default=2.5)
    p.add_argument("--probe-passes", type=int, default=2, help="passes over the concurrencies (best of)")
    p.add_argument("--c-star", type=int, default=None, help="use this concurrency instead of the probe's pick")
    # Default: a narrow 1-layer model, whose decode step cost is dominated by per-step overhead and so grows
    # slowly with the batch, i.e. GPU-like. --hidden 128 --layers 4 is the quick start's model, whose CPU
    # step cost grows ~6x from 4 to 128 in flight (CPU-like: the long tail is then cheap).
    p.add_argument("--hidden", type=int, default=32, help="model width (the subtract_chain task's model is 128 x 4)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--april-over-sampling", type=int, default=2,
                   help="APRIL submits this many x B groups per chunk (--over-sampling-batch-size)")
    p.add_argument("--no-stale-kv-modes", action="store_true",
                   help="skip april_kv / pool_kv (the same modes with --reuse-stale-kv: no re-prefill on resume)")
    p.add_argument("--simulate", action="store_true",
                   help="calibrate the engine (interleaved with the rounds) and print the simulator's prediction of each mode")
    p.add_argument("--calibration", choices=["full", "quick"], default="full",
                   help="--simulate's calibration passes: every probe, or the quick set (seven probes, shorter bursts)")
    p.add_argument("--model-preset", default=None, choices=["quickstart", "qwen3-0.5b"],
                   help="a named model instead of --hidden/--layers/--heads (qwen3-0.5b: a realistic step cost on a GPU)")
    p.add_argument("--model-cache", default=None, help="with --model-preset: build it here, or reuse it from here")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the start (the engines' start included) within which the benchmark prints its "
                        "result: the warm-up, the calibration and further rounds get what one round and the report "
                        "leave (at least one round)")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="at most this long per partial mode's and the limit's warm-up (whichever of it and "
                        "--warmup-steps comes first)")
    p.add_argument("--calibration-seconds", type=float, default=None,
                   help="--simulate: a calibration pass starts nothing new after this long")
    p.add_argument("--calibration-new-tokens", type=int, default=64,
                   help="--simulate: tokens per row of the calibration's probes")
    p.add_argument("--report-seconds", type=float, default=10.0,
                   help="with --time-budget: kept for the simulation and the report at the end")
    p.add_argument("--step-composition", choices=["auto", "mixed", "separate"], default="auto", help="the engines'")
    p.add_argument("--cuda-graph-mode", choices=["auto", "capture", "static", "off"], default="auto", help="the engines'")
    p.add_argument("--json-out", default=None, help="also write the summary JSON here")
    p.add_argument("--log-dir", default=None,
                   help="with several workloads: each run's output here (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:] if argv is None else list(argv)
    opts = p.parse_args(argv)
    if len(opts.workload) > 1:
        return compare_workloads(opts, argv)
    opts.workload = opts.workload[0]
    logging.basicConfig(level=logging.INFO if os.environ.get("VERBOSE") else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as workdir:
        asyncio.run(main_async(opts, workdir))



def compare_workloads(opts, argv: list[str]) -> int:
    """One run per workload, one after the other (each measures its modes interleaved with its limit, so every
    ratio is taken within one run), then their ratios side by side; a figure quoted from here names its workload."""
    log_dir = opts.log_dir or tempfile.mkdtemp(prefix="rollout_workloads_")
    os.makedirs(log_dir, exist_ok=True)
    rows, boxes, failed = [], [], []
    for name in opts.workload:
        out_json, log = (os.path.join(log_dir, f"rollout_{name}.{ext}") for ext in ("json", "log"))
        t0 = time.monotonic()
        print(f"=== {name} (log: {log})", flush=True)
        with open(log, "w") as f:  # argparse keeps an option's last value: these override the command line's
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--workload", name,
                                 "--json-out", out_json], stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not os.path.isfile(out_json):
            print(f"{name}: exited {rc} after {time.monotonic() - t0:.0f}s; see {log}", flush=True)
            failed.append(name)
            continue
        boxes.append({"host_cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)})
        with open(out_json) as f:
            rows.append(workloads_row(name, json.load(f)))
        print(f"{name}: done in {time.monotonic() - t0:.0f}s", flush=True)
    if rows:
        print_workloads_table(rows, boxes)
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump({"rows": rows, "boxes": boxes, "failed": failed, "args": argv}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
