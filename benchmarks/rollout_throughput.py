"""Rollout throughput: synchronous vs APRIL vs pool mode vs the engine's limit.

1. Measures the embedded engine's decode throughput at several concurrencies
   (C requests always in flight) and picks C*, the smallest C within 5% of the
   best (prints the curve and ms per decode step).
2. Long-tailed workload: ignore_eos, each sample's budget `--scale` x q tokens
   with q from the truncated Pareto of the subtract_chain task (alpha 1, cap
   --cap), so max >= 20x median (printed; 43x by default). The scale sets how
   long a step is next to its fixed costs (abort, drain, restart: ~50-100 ms
   of HTTP on this box) and how long parked contexts grow: every parked sample
   is re-prefilled when it resumes, and on this CPU a prefilled token costs
   ~1/4 of a decoded one (on a GPU ~1/100), so the per-round ratios fall as
   the buffer fills with long-tail samples (round 0 starts empty).
3. Modes, each with its own data source (same seed), buffer and policy version:
   sync (B = C*/n groups, no partial rollout), APRIL (partial, over-sampling 2B,
   at most C* in flight), pool (C* in flight), april_kv and pool_kv (the same
   with --reuse-stale-kv: a parked sample resumes on the KV it had instead of
   being re-prefilled), and the limit (C* requests in flight the whole time:
   one steady state across rounds, its unfinished samples continued from one
   slice to the next, with no weight update and so on their cached KV).
   They run interleaved in --rounds rounds (sync, april, pool, april_kv,
   pool_kv, limit, ...), each mode for >= --min-seconds of rollout time per
   round, so drift of the box hits all alike. Before every step a simulated
   weight update bumps the engines' weight_version and, as a real update does
   by default, flushes their cache (not for the _kv modes).
4. With --simulate, calibrates the engine in passes interleaved with the rounds and prints the
   rollout simulator's prediction of every mode beside its measurement (rollout_simcheck.py).
5. Prints per-mode tokens/s (total tokens / total rollout time over all
   rounds), ratios, per-round ratios, the off-policy token ratio and a per-step
   breakdown (time to target, drain and abort->idle, time outside both, gap
   between steps, requests, resumed samples, their tokens so far) and each
   mode's engine time (prefill, decode, idle, cache hits, cost per token); the
   last line is one JSON.

    python benchmarks/rollout_throughput.py [--rounds 3] [--min-seconds 10] [--cap 128] [--scale 24] [--simulate]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import tempfile
import time

import aiohttp
from rollout_report import median, report
from rollout_simcheck import make_calibrator, predict
from rollout_workload import ModeRunner, ParetoSource, constant_load, engine_stats, stats_delta

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.tasks.subtract_chain import VOCAB, sample_steps, write_dataset
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

logger = logging.getLogger("rollout_throughput")


async def main_async(opts, workdir):
    tok = build_tokenizer(VOCAB)
    spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
                         num_key_value_heads=max(1, opts.heads // 2), intermediate_size=2 * opts.hidden,
                         max_position_embeddings=opts.scale * opts.cap + 64)
    build_tiny_qwen3(os.path.join(workdir, "model"), tok, spec, seed=0)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)  # only to satisfy --prompt-data
    base = ["--hf-checkpoint", os.path.join(workdir, "model"), "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1",
            "--rollout-backend", "embedded", "--n-samples-per-prompt", str(opts.n),
            "--rollout-max-response-len", str(opts.scale * opts.cap), "--rollout-seed", str(opts.seed),
            "--run-dir", os.path.join(workdir, "run")]
    probe = parse_args(base + ["--rollout-batch-size", "1"]).replace(rollout_ignore_eos=True)
    vocab = len(tok)
    wl_rng = random.Random(opts.seed)
    lens = sorted(opts.scale * sample_steps(wl_rng, cap=opts.cap) for _ in range(20000))
    print(f"workload: budget tokens median {median(lens)}, mean {sum(lens) / len(lens):.1f}, "
          f"p90 {lens[int(0.9 * len(lens))]}, max {lens[-1]} (max/median {lens[-1] / median(lens):.0f}x); "
          f"model hidden {opts.hidden} x {opts.layers} layers", flush=True)
    t_start = time.monotonic()
    # one HTTP session for every mode and the limit: connections to the router stay open across steps
    with EngineGroup(probe, log_dir=os.path.join(workdir, "logs")) as engines:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max(opts.concurrencies) + 64)) as http:
            # (1) throughput curve
            curve = {}
            await constant_load(probe, engines, http, max(opts.concurrencies), 2.0, ParetoSource(2, 1, opts.cap, vocab, opts.scale))  # warm-up
            for p in range(opts.probe_passes):  # best of a few passes: a busy moment of the box must not pick C*
                for c in opts.concurrencies:
                    v = await constant_load(probe, engines, http, c, opts.probe_seconds, ParetoSource(1 + p, 1, opts.cap, vocab, opts.scale))
                    curve[c] = max(curve.get(c, 0.0), v)
            for c in opts.concurrencies:
                print(f"concurrency {c:4d}: {curve[c]:8.1f} tok/s   ms per decode step ~ {1000 * c / curve[c]:7.2f}", flush=True)
            best = max(curve.values())
            c_star = opts.c_star or min(c for c, v in curve.items() if v >= 0.95 * best)  # smallest C within 5% of best
            c_star = max(opts.n, c_star - c_star % opts.n)
            if c_star not in curve:
                curve[c_star] = await constant_load(probe, engines, http, c_star, opts.probe_seconds,
                                                    ParetoSource(1, 1, opts.cap, vocab, opts.scale))
            b = c_star // opts.n
            print(f"C* = {c_star} (B = {b} groups x n = {opts.n}); step time at C* is "
                  f"{(c_star / curve[c_star]) / (min(curve) / curve[min(curve)]):.2f}x the step time at C={min(curve)}",
                  flush=True)

            def mode_args(*extra):
                return parse_args(base + ["--rollout-batch-size", str(b), "--sglang-server-concurrency", str(c_star),
                                          *extra]).replace(rollout_ignore_eos=True)

            runners = {
                "sync": ModeRunner("sync", mode_args(), engines, http, opts.seed, opts.n, opts.cap, vocab, opts.scale),
                "april": ModeRunner("april", mode_args("--partial-rollout", "--over-sampling-batch-size",
                                                      str(opts.april_over_sampling * b)),
                                    engines, http, opts.seed, opts.n, opts.cap, vocab, opts.scale),
                "pool": ModeRunner("pool", mode_args("--partial-rollout", "--rollout-mode", "pool",
                                                     "--rollout-pool-size", str(c_star)),
                                   engines, http, opts.seed, opts.n, opts.cap, vocab, opts.scale),
            }
            if not opts.no_stale_kv_modes:  # the same two modes resuming on the KV they had (no re-prefill)
                for k in ("april", "pool"):
                    runners[k + "_kv"] = ModeRunner(k + "_kv", runners[k].args.replace(reuse_stale_kv=True), engines,
                                                    http, opts.seed, opts.n, opts.cap, vocab, opts.scale)
            limit_tokens, limit_wall, limit_rounds, limit_running = 0.0, 0.0, [], []
            limit_source = ParetoSource(opts.seed, 1, opts.cap, vocab, opts.scale)
            limit_carry: list = []  # the limit's unfinished samples, continued in its next slice
            limit_engine: dict = {}
            cal = make_calibrator(engines, vocab) if opts.simulate else None
            if cal is not None:
                await cal.measure(http)
            for r in range(opts.rounds):  # interleaved, so drift of the box hits every mode alike
                walls = {k: await runner.run_for(opts.min_seconds, opts.min_steps) for k, runner in runners.items()}
                secs = max(opts.min_seconds, walls["april"])
                e0 = engine_stats(engines)
                tps = await constant_load(probe, engines, http, c_star, secs, limit_source, limit_running,
                                          limit_carry)
                for k, v in stats_delta(engine_stats(engines), e0).items():
                    limit_engine[k] = limit_engine.get(k, 0) + v
                limit_tokens += tps * secs
                limit_wall += secs
                limit_rounds.append(tps)
                print(f"round {r}: " + "  ".join(f"{k} {v.rounds[-1]:.0f}" for k, v in runners.items())
                      + f"  limit {tps:.0f} tok/s", flush=True)
                if cal is not None:
                    await cal.measure(http)
    limit = limit_tokens / limit_wall
    res = {k: v.result() for k, v in runners.items()}
    summary = report(res, limit, limit_rounds, limit_running, limit_wall, limit_engine, c_star, curve, opts.rounds,
                     t_start)
    if cal is not None:
        summary["simulated"] = predict(runners, res, cal, opts, vocab, b, c_star)
    print(json.dumps(summary))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(summary, f, indent=2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (sync, april, pool, april_kv, pool_kv, limit)")
    p.add_argument("--min-seconds", type=float, default=10.0, help="rollout time of each mode in each round")
    p.add_argument("--min-steps", type=int, default=3, help="at least this many steps per mode per round")
    p.add_argument("--n", type=int, default=4, help="samples per prompt group")
    p.add_argument("--cap", type=int, default=128, help="Pareto cap on chain steps q (budget scale x q tokens)")
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
