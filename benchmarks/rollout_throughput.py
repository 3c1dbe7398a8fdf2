"""Rollout throughput: synchronous vs APRIL vs pool mode vs the engine's limit, with its spread.

1. Measures the embedded engine's decode throughput at several concurrencies
   (C requests always in flight) and picks C*, the smallest C within 5% of the
   best (prints the curve and ms per decode step).
2. Workload (`--workload`): ignore_eos; `pareto` (default, long-tailed): each sample's budget `--scale`
   x q tokens with q from the truncated Pareto of the subtract_chain task (alpha 1, cap --cap), so max >=
   20x median (printed; 43x by default); `lognormal`: the APRIL paper's setting as `tools/simulate_rollout.py
   paper` assumes it, scaled to the same cap (median 0.37x the cap, max / median ~2.7x). Every parked sample
   is re-prefilled when it resumes (the simulated weight update flushed its
   KV), which on this CPU costs a good fraction of decoding it (on a GPU
   ~1/100): see the engine cost fit printed per mode.
3. Modes, each with its own data source (same seed), buffer and policy version:
   sync (B = C*/n groups, no partial rollout), APRIL (partial, over-sampling 2B,
   at most C* in flight), pool (C* in flight), april_kv and pool_kv (the same
   with --reuse-stale-kv: a parked sample resumes on the KV it had instead of
   being re-prefilled; they run on an engine of their own, which nothing
   flushes). Before every step a simulated weight update bumps the engine's
   weight_version and, as a real update does by default, flushes its cache
   (not for the _kv modes).
4. The limit: C* requests in flight the whole time on a second engine (same
   command, same pinning), one steady state measured in slices: its unfinished
   samples continue on their KV from one slice to the next (no weight update
   touches that engine), and a slice counts the engine's generated tokens
   between 0.3 s after its start and its stop. It is an upper bound: no
   re-prefill, no ramp, no drain.
5. Warm-up: each partial mode and the limit first run unmeasured until their
   engine has taken --warmup-steps steps (default: the longest budget, 3,072),
   so that both are measured in the long tail's steady state: until the
   buffer and the limit's carry hold their share of long contexts, steps are
   cheaper and, for the modes, re-prefills shorter.
6. Noise control: the engines run pinned to one CPU (--engine-cpus) and this
   driver and the routers to the others (--driver-cpus), the same for every
   mode and the limit. Every mode step is followed by a limit slice as long as
   the step (1-4 s), so each round's ratio compares measurements taken seconds
   apart; rounds (every mode in turn) go on until APRIL/limit's 90% interval
   is within --target-spread (0.05) after --min-rounds (4), at most --rounds
   (8). The box's own noise is printed: how much one limit slice differs from
   the previous one, and the load average.
7. Prints per mode: tok/s, the ratio to the limit (mean over rounds +- the
   half-width of its 90% interval, and the std), the ratio to sync, per-round
   ratios, the off-policy token ratio, engine running rows against the
   limit's, a per-step breakdown (time to target, drain and abort->idle, time
   outside both, gap between steps, requests, resumed samples, their tokens
   so far) and the engine's time and cost fit (ms per step, us per decoding
   row, us per prefilled token); the last line is one JSON with the spreads.
8. With --simulate, calibrates the modes' engine in passes interleaved with the rounds and prints the
   rollout simulator's prediction of every mode beside its measurement (rollout_simcheck.py).
9. On a GPU nothing changes but the engines' device (the embedded engine's --device auto picks cuda): no Ray is
   needed, only sglang-router. `--model-preset qwen3-0.5b` makes the step cost realistic there (a random Qwen3
   with Qwen3-0.6B's width, 16 layers, 151,936-token vocabulary; benchmarks/gpu_check.sh runs it).

    python benchmarks/rollout_throughput.py [--rounds 8] [--min-seconds 6] [--cap 128] [--scale 24] [--simulate]
        [--model-preset qwen3-0.5b] [--time-budget SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import requests
from rollout_report import median, report, spread
from rollout_simcheck import make_calibrator, predict
from rollout_workload import (WORKLOADS, BudgetSource, ModeRunner, constant_load, engine_stats, stats_delta,
                              workload_lengths, workload_summary)

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.gc_utils import freeze_gc_heap
from slime.utils.tiny_model import TinyQwen3Spec, build_preset, build_tiny_qwen3, build_tokenizer, model_preset

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
        spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
                             num_key_value_heads=max(1, opts.heads // 2), intermediate_size=2 * opts.hidden,
                             max_position_embeddings=opts.scale * opts.cap + 64)
        model_dir = os.path.join(workdir, "model")
        build_tiny_qwen3(model_dir, tok, spec, seed=0)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)  # only to satisfy --prompt-data
    base = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1",
            "--rollout-backend", "embedded", "--n-samples-per-prompt", str(opts.n),
            "--rollout-max-response-len", str(opts.scale * opts.cap), "--rollout-seed", str(opts.seed),
            "--run-dir", os.path.join(workdir, "run")]
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
            # What the rest costs at this engine's step time (seconds per decode step at C*): a round (a sync step
            # lasts about as many decode steps as the longest budget), the calibration and the report; the warm-up
            # gets what --time-budget leaves beyond them.
            plan = clock.plan(opts, step_s=c_star / curve[c_star], modes=list(runners),
                              warm_runs=sum(1 for r in runners.values() if r.args.partial_rollout) + 1)
            print(plan.describe(), flush=True)
            # Warm-up, not measured: the long tail takes a while to reach its steady state (the longest
            # sample needs as many decode steps as its budget), in the limit's carry as in each partial mode's
            # buffer; until then contexts are shorter and steps cheaper, and a mode or the limit measured
            # earlier in its own warm-up than the other would look better than it is.
            warm_steps = opts.scale * opts.cap if opts.warmup_steps is None else opts.warmup_steps
            t_warm = time.monotonic()
            warm = {k: await r.warm_up(warm_steps, plan.warmup_s) for k, r in runners.items() if r.args.partial_rollout}
            limit_ran = await limit.warm_up(warm_steps, plan.warmup_s)
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
            cal_pass_s = 0.0
            if cal is not None:
                cal_pass_s = await calibrate_pass(cal, http, speed, pinning, plan.calibration_deadline(first=True))
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
                    cal_pass_s = await calibrate_pass(cal, http, speed, pinning, plan.calibration_deadline(first=False))
                if r + 1 >= opts.min_rounds and spread(ratios["april"])["ci90"] <= opts.target_spread:
                    break
                if r + 1 < opts.rounds and not plan.room_for(round_s + cal_pass_s, "another round"):
                    break
    res = {k: v.result() for k, v in runners.items()}
    summary = report(res, ratios, limit, c_star, curve, loads, pinning, opts, clock.t_start)
    summary["engine"] = device
    summary["workload"] = workload
    summary["time_budget"] = plan.to_dict()
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


class Clock:
    """--time-budget: seconds since the start (the engines' start included) and what is left."""

    def __init__(self, budget: float | None):
        self.t_start, self.budget = time.monotonic(), budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def left(self) -> float:
        return float("inf") if self.budget is None else self.budget - self.elapsed()

    def plan(self, opts, step_s: float, modes: list[str], warm_runs: int) -> "Plan":
        return Plan(self, opts, step_s, modes, warm_runs)


class Plan:
    """What each phase may take within --time-budget, from the engine's step time: one round is always run (and
    the first calibration pass when --simulate: it stops early if it must, see Calibrator.measure); the warm-up gets
    the rest, at most --warmup-seconds per partial mode and for the limit. Within a round each mode gets a share of
    what is left before the report's reserve (at least one step each)."""

    STEP_OVERHEAD_S = 0.6  # per mode step beyond it and its limit slice: the limit's ramp, the weight-version bump,
    # the engines' counters, the abort

    def __init__(self, clock: Clock, opts, step_s: float, modes: list[str], warm_runs: int):
        self.clock, self.opts, self.step_s = clock, opts, step_s
        self.sync_s = 1.2 * opts.scale * opts.cap * step_s + 0.5  # its longest sample's decode steps, ramp, drain
        # before the warm-up: a partial mode's step guessed at a quarter of sync's (measured in the warm-up)
        self.mode_s = {m: self._mode_s(self.sync_s if m == "sync" else max(0.2, self.sync_s / 4)) for m in modes}
        self.report_s = opts.report_seconds
        self.calibration_s = opts.calibration_seconds if opts.simulate else 0.0
        self.warmup_s = opts.warmup_seconds
        self.warm_runs = warm_runs
        left = clock.left()
        if left != float("inf"):
            room = (left - self.round_s - (self.calibration_s or 0.0) - self.report_s) / warm_runs
            self.warmup_s = max(0.0, room if self.warmup_s is None else min(self.warmup_s, room))

    def _mode_s(self, step_s: float) -> float:
        """A mode's time in a round: steps until --min-seconds, each followed by a limit slice as long (clipped)."""
        o = self.opts
        steps = max(o.min_steps, -(-o.min_seconds // max(step_s, 1e-3)))
        return steps * (step_s + min(max(step_s, o.limit_min_seconds), o.limit_seconds) + self.STEP_OVERHEAD_S)

    @property
    def round_s(self) -> float:
        return sum(self.mode_s.values())

    def measured(self, runners: dict) -> None:
        """The partial modes' step time from their warm-up."""
        for k, r in runners.items():
            if r.warm_step_s:
                self.mode_s[k] = self._mode_s(r.warm_step_s)

    def calibration_deadline(self, first: bool) -> float | None:
        """A calibration pass's deadline: --calibration-seconds from now, and never past what the report (and, for
        the `first` pass, before any round, one round) still needs."""
        ends = []
        if self.calibration_s:
            ends.append(time.monotonic() + self.calibration_s)
        if self.clock.budget is not None:
            ends.append(self.clock.t_start + self.clock.budget - self.report_s - (self.round_s if first else 0.0))
        return min(ends) if ends else None

    def mode_deadline(self, mode: str, later: list[str]) -> float | None:
        """When `mode` starts no new step in this round: its share (by the planned times of it and the `later` modes
        of the round) of the time left before the report's reserve."""
        if self.clock.budget is None:
            return None
        left = self.clock.left() - self.report_s
        share = self.mode_s[mode] / (self.mode_s[mode] + sum(self.mode_s[m] for m in later))
        return time.monotonic() + max(0.0, left) * share

    def room_for(self, seconds: float, what: str) -> bool:
        """Whether `seconds` more fit before the report's reserve (printed when not)."""
        if self.clock.left() - self.report_s >= seconds:
            return True
        print(f"--time-budget {self.clock.budget:.0f}s: no room for {what} (~{seconds:.0f}s; {self.clock.left():.0f}s "
              f"left, {self.report_s:.0f}s kept for the report)", flush=True)
        return False

    def describe(self) -> str:
        out = (f"plan: {1e3 * self.step_s:.1f} ms per decode step at C*; a round ~{self.round_s:.0f}s (a sync step "
               f"~{self.sync_s:.1f}s)")
        if self.clock.budget is not None:
            out += (f"; --time-budget {self.clock.budget:.0f}s, {self.clock.left():.0f}s left: warm-up up to "
                    f"{self.warmup_s:.1f}s x {self.warm_runs}, calibration up to {self.calibration_s or 0:.0f}s, "
                    f"report {self.report_s:.0f}s")
        elif self.warmup_s is not None:
            out += f"; warm-up up to {self.warmup_s:.1f}s x {self.warm_runs}"
        return out

    def to_dict(self) -> dict:
        return {"budget_s": self.clock.budget, "step_ms": round(1e3 * self.step_s, 3),
                "round_s_planned": round(self.round_s, 1),
                "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 1),
                "elapsed_s": round(self.clock.elapsed(), 1)}


def engine_device(engines) -> dict:
    """Where the modes' engine runs (its /get_server_info): device, its name, dtype."""
    info = requests.get(engines.worker_urls()[0] + "/get_server_info", timeout=30).json()
    return {"device": info.get("device", "cpu"), "device_name": info.get("device_name", "cpu"), "dtype": info.get("dtype")}


# issue 27's acceptance on a GPU: APRIL >= 1.2x sync and >= 0.85x the limit; the simulator within 15% of each mode
GPU_TARGETS = {"april_over_sync": 1.2, "april_over_limit": 0.85, "sim_error": 0.15}


def gpu_acceptance(summary: dict) -> dict:
    """The acceptance checks, printed and returned (meaningful when the engines ran on a GPU); the simulator's only
    when it predicted (--simulate and a calibration that fitted)."""
    sim = summary.get("simulated")
    out = {"engine_device": summary["engine"]["device"],
           "april_over_sync>=1.2": summary["april_over_sync"] >= GPU_TARGETS["april_over_sync"],
           "april_over_limit>=0.85": summary["april_over_limit"] >= GPU_TARGETS["april_over_limit"]}
    line = (f"acceptance (issue 27, engines on {out['engine_device']}): APRIL {summary['april_over_sync']:.2f}x sync "
            f"(>= 1.2: {out['april_over_sync>=1.2']}), {summary['april_over_limit']:.3f}x the limit (>= 0.85: "
            f"{out['april_over_limit>=0.85']}); pool {summary['pool_over_limit']:.3f}x, sync "
            f"{summary['sync_over_limit']:.3f}x the limit")
    if sim:
        for m in ("sync", "april", "pool"):
            out[f"sim_{m}_within_15%"] = abs(sim[m]["error"]) <= GPU_TARGETS["sim_error"]
        line += ("; simulator error " + ", ".join(f"{m} {100 * sim[m]['error']:+.1f}%" for m in ("sync", "april", "pool"))
                 + f" (within 15%: {all(out[f'sim_{m}_within_15%'] for m in ('sync', 'april', 'pool'))})")
    elif "simulated" in summary:  # --simulate, but no fit
        line += "; simulator: no prediction"
    print(line, flush=True)
    return out


async def calibrate_pass(cal, http, speed: dict, pinning: dict, deadline: float | None = None) -> float:
    """One calibration pass (nothing new started after `deadline`), with the box's speed on the engines' CPU timed
    before and after it; returns its seconds."""
    t0 = time.monotonic()
    speed.setdefault("calibration", []).append(await box_speed(pinning))
    complete = await cal.measure(http, deadline=deadline)
    speed["calibration"].append(await box_speed(pinning))
    took = time.monotonic() - t0
    print(f"calibration pass {'done' if complete else 'cut short (see the warning above)'} in {took:.1f}s", flush=True)
    return took


# a fixed piece of pure-Python work: its time on the engines' CPU says how fast that CPU runs now (a shared host's
# neighbours can slow a VM's CPU by 20% for tens of seconds without any load showing inside the VM)
_SPEED_PROBE = ("import os, sys, time\nos.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
                "best = 1e9\nfor _ in range(5):\n    t = time.perf_counter()\n"
                "    sum(i * i for i in range(100000))\n    best = min(best, time.perf_counter() - t)\nprint(best)")


async def box_speed(pinning: dict) -> float:
    """Seconds of the fixed probe (best of 5) in a process pinned to the engines' CPUs."""
    cpus = ",".join(str(c) for c in pinning["engines"])
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _SPEED_PROBE, cpus,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return float(out.decode().strip())


# a limit slice counts the engine's tokens from this long after its requests went in (the ramp up is not
# the steady state) until its stop
RAMP_S = 0.3


class LimitRunner:
    """The full-occupancy limit: C* requests in flight the whole time, as one steady state measured in
    slices (its unfinished samples continue, on their KV, in the next slice)."""

    def __init__(self, args, engines, http, concurrency: int, source):
        self.args, self.engines, self.http, self.concurrency, self.source = args, engines, http, concurrency, source
        self.carry: list = []
        self.slices: list[float] = []
        self.seconds: list[float] = []
        self.running: list[float] = []
        self.engine: dict = {}

    async def slice(self, seconds: float) -> float:
        e0 = engine_stats(self.engines)
        tps = await constant_load(self.args, self.engines, self.http, self.concurrency, seconds, self.source,
                                  self.running, self.carry, ramp=RAMP_S)
        for k, v in stats_delta(engine_stats(self.engines), e0).items():
            self.engine[k] = self.engine.get(k, 0) + v
        self.slices.append(tps)
        self.seconds.append(seconds)
        return tps

    async def warm_up(self, engine_steps: int, seconds: float | None = None) -> int:
        """Slices (not measured) until the engine ran `engine_steps` forward steps, or (`seconds`) for that long;
        returns the engine steps it ran."""
        t_end = None if seconds is None else time.monotonic() + seconds
        ran = 0
        while ran < engine_steps and (t_end is None or time.monotonic() < t_end - 0.2):
            await self.slice(4.0 if t_end is None else max(0.2, min(4.0, t_end - time.monotonic() - RAMP_S)))
            ran = self.engine.get("decode_steps", 0) + self.engine.get("prefills", 0)
        self.reset_measurements()
        return ran

    def reset_measurements(self) -> None:
        self.slices, self.seconds, self.running, self.engine = [], [], [], {}

    @property
    def tok_s(self) -> float:
        return sum(t * s for t, s in zip(self.slices, self.seconds)) / sum(self.seconds)


def pin_processes(groups, engine_cpus: str | None, driver_cpus: str | None, separate: bool = False) -> dict:
    """Pin every engine process (all its threads) to `engine_cpus` and this driver and the routers to
    `driver_cpus` (default on a box of >= 2 CPUs: engines on the last CPU, the rest for the driver), the same
    for every mode and the limit, so modes never differ in where their work runs.

    `separate` (engines on a GPU): without --engine-cpus, each engine gets CPUs of its own (up to 3, the last ones)
    and the driver the rest. There an engine's step is the host's work (launching its kernels) and its HTTP side
    answers the requests: on one CPU shared by every engine, both halves of each contend, and a decode step took
    2x what the same engine took alone. "engines" is then the modes' engine's CPUs (where box_speed runs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 and not (engine_cpus or driver_cpus):
        return {"engines": cpus, "driver": cpus, "note": "one CPU: nothing pinned"}
    procs = [e for g in groups for e in g.engines]
    each = min(3, (len(cpus) - 2) // max(1, len(procs))) if separate and not engine_cpus else 0
    if each >= 1:
        own = [cpus[len(cpus) - (i + 1) * each: len(cpus) - i * each] for i in range(len(procs))]
        taken = {c for cs in own for c in cs}
        drv = _cpu_list(driver_cpus) if driver_cpus else [c for c in cpus if c not in taken]
        for e, cs in zip(procs, own):
            _pin_all_threads(e.pid, cs)
        eng = own[0]
    else:
        eng = _cpu_list(engine_cpus) if engine_cpus else cpus[-1:]
        drv = _cpu_list(driver_cpus) if driver_cpus else [c for c in cpus if c not in eng] or cpus
        for e in procs:
            _pin_all_threads(e.pid, eng)
    for g in groups:
        if g.router.process is not None:
            _pin_all_threads(g.router.process.pid, drv)
    _pin_all_threads(os.getpid(), drv)
    out = {"engines": eng, "driver": drv, "engine_threads": 1}
    if each >= 1:
        out["engine_cpus_each"] = own
    return out


def _cpu_list(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _pin_all_threads(pid: int, cpus: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass


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
    p.add_argument("--workload", choices=WORKLOADS, default="pareto",
                   help="budgets: pareto (long tail, max/median 21-43x) or lognormal (the APRIL paper's shape, ~2.7x)")
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
    p.add_argument("--json-out", default=None, help="also write the summary JSON here")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("VERBOSE") else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as workdir:
        asyncio.run(main_async(opts, workdir))


if __name__ == "__main__":
    sys.exit(main())
