"""`--over-sampling-batch-size auto` vs the best fixed size found by a sweep, on the same workload.

The rollout benchmark's engine, model and long-tailed workload (`rollout_workload.py`): APRIL
(`--partial-rollout`) at fixed over-sampling sizes B x {1, 1.5, 2, 3, 4} (B = C*/n groups) and
`auto`, each with its own data source (same seed), buffer and policy version, interleaved step by
step so drift of the box hits all alike. `auto` starts knowing nothing: it calibrates the engine
once before its first step (not timed, as a run does it once) and then sizes every step from what
it saw (its planning time is counted). Prints every size's tokens/s, the best fixed size, auto's
tokens/s and the sizes it chose; the last line is JSON.

    python benchmarks/over_sampling_auto.py [--seconds 30] [--scale 8] [--c-star 64]
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
from rollout_workload import BudgetSource, ModeRunner, constant_load, workload_lengths

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.rollout.simulator.calibrate import Calibrator
from slime.rollout.simulator.planner import OverSamplingPlanner
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.gc_utils import freeze_gc_heap
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

logger = logging.getLogger("over_sampling_auto")


async def main_async(opts, workdir) -> dict:
    tok = build_tokenizer(VOCAB)
    spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * opts.hidden,
                         max_position_embeddings=opts.scale * opts.cap + 64)
    build_tiny_qwen3(os.path.join(workdir, "model"), tok, spec, seed=0)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)
    base = ["--hf-checkpoint", os.path.join(workdir, "model"), "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1", "--rollout-backend", "embedded",
            "--n-samples-per-prompt", str(opts.n), "--rollout-max-response-len", str(opts.scale * opts.cap),
            "--rollout-seed", str(opts.seed), "--run-dir", os.path.join(workdir, "run")]
    vocab = len(tok)
    probe = parse_args(base + ["--rollout-batch-size", "1"]).replace(rollout_ignore_eos=True)
    lengths = workload_lengths("pareto", opts.scale, opts.cap)
    t_start = time.monotonic()
    with EngineGroup(probe, log_dir=os.path.join(workdir, "logs")) as engines:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4 * opts.c_star + 64)) as http:
            await constant_load(probe, engines, http, opts.c_star, 1.0, BudgetSource(lengths, 2, 1, vocab))
            b = max(1, opts.c_star // opts.n)

            def args_for(size) -> object:
                return parse_args(base + ["--rollout-batch-size", str(b), "--sglang-server-concurrency", str(opts.c_star),
                                          "--partial-rollout", "--over-sampling-batch-size", str(size)]
                                  ).replace(rollout_ignore_eos=True)

            runners = {}
            for f in opts.factors:
                size = max(1, round(f * b))
                runners[f"os={size}"] = ModeRunner(f"os={size}", args_for(size), engines, http,
                                                   BudgetSource(lengths, opts.seed, opts.n, vocab))
            auto_args = args_for("auto")
            planner = OverSamplingPlanner.from_args(auto_args)
            cal = Calibrator(engines.worker_urls()[0], vocab, client_url=engines.router_url,
                             name="embedded engine (calibrated by auto)")
            await cal.measure(http)  # what a run does once after its first step; not timed here
            planner.cost = cal.fit("median")
            runners["auto"] = ModeRunner("auto", auto_args, engines, http, BudgetSource(lengths, opts.seed, opts.n, vocab),
                                         planner=planner)
            freeze_gc_heap("over-sampling benchmark")  # as the RolloutManager does once started
            # one step of each size in turn, until every size has had its rollout time: a busy moment of the box
            # falls on all sizes alike (slices of seconds would let one size take a whole busy spell)
            while min(r.wall for r in runners.values()) < opts.seconds:
                for runner in runners.values():
                    await runner.run_for(0.0, 1)
            print("per-size rollout seconds: " + "  ".join(f"{k} {v.wall:.1f}" for k, v in runners.items()), flush=True)
    res = {k: v.result() for k, v in runners.items()}
    fixed = {k: v["tok_s"] for k, v in res.items() if k != "auto"}
    best = max(fixed, key=fixed.get)
    chosen = [int(x) for x in runners["auto"].stats["over_sampling"]]
    print(f"\n{'size':8s} {'tok/s':>8s} {'/best':>6s} {'off-pol':>7s} {'steps':>5s}")
    for k, v in res.items():
        print(f"{k:8s} {v['tok_s']:8.1f} {v['tok_s'] / fixed[best]:6.3f} {v['off_policy']:7.3f} {v['steps']:5d}")
    for h in planner.history:
        print(f"  plan after step {h['after_step']}: {h['choice']} ({h['finished']} finished + {h['unfinished']} unfinished "
              f"samples seen; predicted goodput {h['goodput']})")
    print(f"auto chose (per step): {chosen}; B = {b} groups x n = {opts.n}, C* = {opts.c_star}; "
          f"total {time.monotonic() - t_start:.0f}s")
    return {"b": b, "c_star": opts.c_star, "tok_s": {k: round(v["tok_s"], 1) for k, v in res.items()},
            "best_fixed": best, "best_fixed_tok_s": round(fixed[best], 1), "auto_tok_s": round(res["auto"]["tok_s"], 1),
            "auto_over_best": round(res["auto"]["tok_s"] / fixed[best], 4), "auto_sizes": chosen,
            "off_policy": {k: round(v["off_policy"], 4) for k, v in res.items()},
            "cost_model": planner.cost.describe(), "plans": planner.history, "targets_met": {"auto>=0.95*best": res["auto"]["tok_s"] >= 0.95 * fixed[best]}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="rollout time of every size (steps interleaved)")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--scale", type=int, default=8, help="tokens per chain step (8: median 24, max 1024)")
    p.add_argument("--c-star", type=int, default=64, help="requests in flight per engine (B = C*/n groups)")
    p.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0, 4.0],
                   help="fixed over-sampling sizes, as multiples of B")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("VERBOSE") else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="os_auto_") as workdir:
        summary = asyncio.run(main_async(opts, workdir))
    print(json.dumps(summary))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
