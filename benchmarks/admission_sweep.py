"""--admission auto against a sweep of fixed pool sizes, side by side on one engine (pool mode, APRIL's rollout).

The rollout benchmark's workload (benchmarks/rollout_workload.py: ignore_eos, per-sample budgets of `--workload`,
pareto: `--scale` x q, q from the subtract_chain task's truncated Pareto; a simulated weight update with a cache
flush before every step, so parked samples are prefilled again when they resume) run by `--rollout-mode pool --partial-rollout`
with a fixed `--rollout-pool-size` P for each P of `--sizes`, and with `--admission auto` (at most the largest P,
no other tuning). Every mode has its own data source and buffer (same seed) and is warmed up first; then rounds
run every mode in turn for `--min-seconds` of rollout each, so the box's drift hits them alike (short slices, many
rounds: a step's tokens/s varies 20-30% from step to step on the shared 2-core box, and its load drifts within a
minute). Per mode: tokens per second of rollout (all its measured tokens over all its rollout time), and for auto
its limit at the end and its probes; the ratio auto / the best fixed size is taken round by round (the best chosen
by its tokens/s), printed as mean +- the half-width of a 90% interval, beside the ratio of the totals.

    python benchmarks/admission_sweep.py [--sizes 16 32 64 128 256] [--rounds 40] [--min-seconds 2]

The last line is JSON. Results, box and date: benchmarks/README.md (its `--admission auto` row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rollout_report import spread  # noqa: E402
from rollout_workload import WORKLOADS, BudgetSource, ModeRunner, build_bench_model, workload_lengths  # noqa: E402

from slime.arguments import parse_args  # noqa: E402
from slime.backends.sglang_utils.engine_group import EngineGroup  # noqa: E402
from slime.tasks.subtract_chain import VOCAB, write_dataset  # noqa: E402
from slime.utils.tiny_model import build_tokenizer  # noqa: E402

logger = logging.getLogger("admission_sweep")


async def main_async(opts, workdir: str) -> dict:
    tok = build_tokenizer(VOCAB)
    model_dir, _ = build_bench_model(opts, workdir, tok)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)  # only to satisfy --prompt-data
    ceiling = max(opts.sizes)
    base = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1", "--rollout-backend", "embedded",
            "--n-samples-per-prompt", str(opts.n), "--rollout-max-response-len", str(opts.scale * opts.cap),
            "--rollout-seed", str(opts.seed), "--run-dir", os.path.join(workdir, "run"),
            "--rollout-batch-size", str(opts.batch), "--sglang-server-concurrency", str(ceiling),
            "--sglang-max-running-requests", str(opts.max_running), "--partial-rollout", "--rollout-mode", "pool"]
    vocab = len(tok)
    lengths = workload_lengths(opts.workload, opts.scale, opts.cap)
    group = EngineGroup(parse_args(base), log_dir=os.path.join(workdir, "logs")).start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=ceiling + 64)) as http:
            runners = {}
            for size in opts.sizes:
                args = parse_args(base + ["--rollout-pool-size", str(size)]).replace(rollout_ignore_eos=True)
                runners[f"fixed_{size}"] = ModeRunner(f"fixed_{size}", args, group, http,
                                                      BudgetSource(lengths, opts.seed, opts.n, vocab))
            auto_args = parse_args(base + ["--admission", "auto"]).replace(rollout_ignore_eos=True)
            runners["auto"] = ModeRunner("auto", auto_args, group, http, BudgetSource(lengths, opts.seed, opts.n, vocab))
            control = runners["auto"].rollout.admission  # the pool's controller, learning across steps
            t0 = time.monotonic()
            for name, r in runners.items():
                await r.warm_up(opts.warmup_engine_steps, opts.warmup_seconds)
            print(f"warm-up {time.monotonic() - t0:.0f}s; auto's limit after it: {control.limit}", flush=True)
            loads, auto_limits, ran_at = [], {}, [control.limit]

            async def count_limit(_dt):  # the limit auto's step ran at (its after_step has moved it since)
                auto_limits[ran_at[0]] = auto_limits.get(ran_at[0], 0) + 1
                ran_at[0] = control.limit

            for rnd in range(opts.rounds):
                for name, r in runners.items():
                    await r.run_for(opts.min_seconds, opts.min_steps, after_step=count_limit if name == "auto" else None)
                loads.append(os.getloadavg()[0])
                if rnd % max(1, opts.rounds // 10) == 0 or rnd == opts.rounds - 1:
                    print(f"round {rnd}: " + "  ".join(f"{k} {r.rounds[-1]:.0f}" for k, r in runners.items())
                          + f" tok/s; auto limit {control.limit}; load {loads[-1]:.1f}", flush=True)
    finally:
        group.shutdown()
    res = {k: r.result() for k, r in runners.items()}
    fixed = {k: v for k, v in res.items() if k.startswith("fixed_")}
    best = max(fixed, key=lambda k: fixed[k]["tok_s"])
    ratios = [a / b for a, b in zip(res["auto"]["rounds"], res[best]["rounds"])]
    summary = {
        "workload": {"name": opts.workload, "scale": opts.scale, "cap": opts.cap, "n": opts.n, "batch": opts.batch,
                     "max_running": opts.max_running, "model": f"{opts.hidden}x{opts.layers}"},
        "tok_s": {k: round(v["tok_s"], 1) for k, v in res.items()},
        "best_fixed": best, "auto_over_best": spread(ratios),
        "auto_over_best_totals": res["auto"]["tok_s"] / res[best]["tok_s"], "auto_limit_end": control.limit,
        "auto_limits": auto_limits,
        "auto_changes": control.metrics(), "load": [round(x, 2) for x in loads], "rounds": opts.rounds,
    }
    for k, v in summary["tok_s"].items():
        print(f"{k:>10}: {v:8.1f} tok/s" + ("   <- best fixed" if k == best else ""), flush=True)
    s = summary["auto_over_best"]
    print(f"auto / best fixed ({best}): {s['mean']:.3f} +- {s['ci90']:.3f} (90% interval, {len(ratios)} rounds), "
          f"totals {summary['auto_over_best_totals']:.3f}; auto's limit at the end {control.limit}, steps per limit "
          f"{dict(sorted(auto_limits.items()))}, probes {control.climb.probes} (won {control.climb.wins})", flush=True)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--min-seconds", type=float, default=2.0, help="rollout time of each mode in each round")
    p.add_argument("--min-steps", type=int, default=1)
    p.add_argument("--warmup-engine-steps", type=int, default=1500, help="engine steps each mode warms up for")
    p.add_argument("--warmup-seconds", type=float, default=60.0, help="at most this long per mode")
    p.add_argument("--batch", type=int, default=16, help="--rollout-batch-size (groups per step)")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--workload", choices=WORKLOADS, default="pareto")
    p.add_argument("--cap", type=int, default=64)
    p.add_argument("--scale", type=int, default=8)
    p.add_argument("--max-running", type=int, default=128, help="the engine's --max-running-requests")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="admission_sweep_") as workdir:
        summary = asyncio.run(main_async(opts, workdir))
    print(json.dumps(summary))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
