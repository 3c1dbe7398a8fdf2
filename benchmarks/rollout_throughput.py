"""Rollout throughput: synchronous vs APRIL vs pool mode vs the engine's limit.

1. Measures the embedded engine's decode throughput at several concurrencies
   (C requests always in flight) and picks the best C* (prints the curve).
2. Long-tailed workload: ignore_eos, each sample's budget 3q tokens with q from
   the truncated Pareto of the subtract_chain task (alpha 1, cap --cap), so
   max >= 20x median.
3. Same seed and steps: sync (B = C*/n groups, no partial rollout), APRIL
   (partial, over-sampling 2B, at most C* in flight), pool (C* in flight), and
   the limit (C* requests in flight the whole time). The engines' weight_version
   is bumped between steps to simulate training.
4. Prints tokens/s, ratios, the off-policy token ratio; last line is one JSON.

    python benchmarks/rollout_throughput.py [--steps 4] [--n 4] [--cap 128]
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
import requests

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.ray.buffer import TRAINED, PartialRolloutBuffer
from slime.rollout.base_types import RolloutContext
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.sglang_rollout import generate_rollout_async
from slime.tasks.subtract_chain import VOCAB, sample_steps, write_dataset
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer
from slime.utils.types import Sample

logger = logging.getLogger("rollout_throughput")


class ParetoSource:
    """Deterministic fresh groups: random 6-token prompts, per-sample budgets 3q, q ~ truncated Pareto."""

    def __init__(self, seed: int, n: int, cap: int, vocab: int):
        self.rng, self.n, self.cap, self.vocab = random.Random(seed), n, cap, vocab
        self.group_counter = self.sample_counter = 0

    def sample(self, group_index: int) -> Sample:
        s = Sample(index=self.sample_counter, group_index=group_index,
                   tokens=[1] + [self.rng.randrange(3, self.vocab) for _ in range(5)], label="00")
        s.metadata["max_response_len"] = 3 * sample_steps(self.rng, cap=self.cap)
        self.sample_counter += 1
        return s

    def get_groups(self, num: int) -> list[list[Sample]]:
        out = []
        for _ in range(num):
            out.append([self.sample(self.group_counter) for _ in range(self.n)])
            self.group_counter += 1
        return out


async def constant_load(args, engines, concurrency: int, seconds: float, source) -> float:
    """Tokens/s with `concurrency` requests in flight the whole time (fresh samples as each finishes)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8)) as session:
        req = SampleRequester(args, session, engines.router_url, sampling_params_from_args(args), 0, 0)
        deadline = time.monotonic() + seconds
        stop = asyncio.Event()

        async def worker():
            while time.monotonic() < deadline:
                await req.generate(source.get_groups(1)[0][0], stop)

        t0 = time.monotonic()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(seconds)
        stop.set()
        await engines.abort_all_until_idle(timeout=60)
        await asyncio.gather(*tasks)
        return req.new_tokens / (time.monotonic() - t0)


def bump_version(engines, version: int) -> None:
    for url in engines.worker_urls():
        requests.post(url + "/update_weight_version", json={"new_version": str(version), "abort_all_requests": False},
                      timeout=30).raise_for_status()


async def run_mode(name, args, engines, steps, seed, n, cap, vocab):
    source = ParetoSource(seed, n, cap, vocab)
    buffer = PartialRolloutBuffer(args)
    tokens, wall, off, total_tok = 0, 0.0, 0.0, 0.0
    for step in range(steps):
        bump_version(engines, step)
        t0 = time.monotonic()
        out = await generate_rollout_async(args, step, RolloutContext(source, buffer, engines, None, step))
        wall += time.monotonic() - t0
        m = out.metrics
        tokens += m["rollout/new_tokens"]
        off += m["rollout/off_policy_tokens"]
        total_tok += m["rollout/trained_tokens"]
        buffer.mark([g[0].group_index for g in out.groups], TRAINED)
        logger.info("%s step %d: %.0f tok/s, %d groups, parked %d, in-flight peak %d, off-policy %.3f, abort->idle %.3fs",
                    name, step, m["rollout/tokens_per_s"], len(out.groups), m["rollout/groups_parked"],
                    m["rollout/in_flight_peak"], m["rollout/off_policy_token_ratio"], m["rollout/abort_to_idle_s"])
    buffer.check_balanced()
    return {"tok_s": tokens / wall, "wall_s": wall, "off_policy": off / total_tok if total_tok else 0.0}


async def main_async(opts, workdir):
    tok = build_tokenizer(VOCAB)
    spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=2 * opts.hidden, max_position_embeddings=4 * opts.cap + 64)
    build_tiny_qwen3(os.path.join(workdir, "model"), tok, spec, seed=0)
    write_dataset(os.path.join(workdir, "prompts.jsonl"), 10, seed=0)  # only to satisfy --prompt-data
    base = ["--hf-checkpoint", os.path.join(workdir, "model"), "--prompt-data", os.path.join(workdir, "prompts.jsonl"),
            "--rm-type", "subtract_chain", "--num-rollout", "1",
            "--rollout-backend", "embedded", "--n-samples-per-prompt", str(opts.n),
            "--rollout-max-response-len", str(3 * opts.cap), "--rollout-seed", str(opts.seed)]
    probe = parse_args(base + ["--rollout-batch-size", "1"]).replace(rollout_ignore_eos=True)
    vocab = len(tok)
    with EngineGroup(probe, log_dir=os.path.join(workdir, "logs")) as engines:
        # (1) throughput curve
        curve = {}
        await constant_load(probe, engines, max(opts.concurrencies), 2.0, ParetoSource(2, 1, opts.cap, vocab))  # warm-up
        for c in opts.concurrencies:
            curve[c] = await constant_load(probe, engines, c, opts.probe_seconds, ParetoSource(1, 1, opts.cap, vocab))
            print(f"concurrency {c:4d}: {curve[c]:8.1f} tok/s", flush=True)
        best = max(curve.values())
        c_star = min(c for c, v in curve.items() if v >= 0.95 * best)  # smallest C within 5% of the best
        c_star = max(opts.n, c_star - c_star % opts.n)
        b = c_star // opts.n
        print(f"C* = {c_star} (B = {b} groups x n = {opts.n}); step time per token nearly flat up to C*:", flush=True)
        for c, v in curve.items():
            print(f"  C={c:4d}  ms per decode step ~ {1000 * c / v:7.2f}", flush=True)

        def mode_args(*extra):
            return parse_args(base + ["--rollout-batch-size", str(b), "--sglang-server-concurrency", str(c_star),
                                      *extra]).replace(rollout_ignore_eos=True)

        res = {}
        res["sync"] = await run_mode("sync", mode_args(), engines, opts.steps, opts.seed, opts.n, opts.cap, vocab)
        res["april"] = await run_mode("april", mode_args("--partial-rollout", "--over-sampling-batch-size", str(2 * b)),
                                      engines, opts.steps, opts.seed, opts.n, opts.cap, vocab)
        res["pool"] = await run_mode("pool", mode_args("--partial-rollout", "--rollout-mode", "pool",
                                                       "--rollout-pool-size", str(c_star)),
                                     engines, opts.steps, opts.seed, opts.n, opts.cap, vocab)
        limit = await constant_load(probe, engines, c_star, max(opts.limit_seconds, res["april"]["wall_s"]),
                                    ParetoSource(opts.seed, 1, opts.cap, vocab))
    for k, r in res.items():
        print(f"{k:6s}: {r['tok_s']:8.1f} tok/s  x{r['tok_s'] / res['sync']['tok_s']:.2f} sync  "
              f"x{r['tok_s'] / limit:.2f} limit  off-policy tokens {r['off_policy']:.3f}  ({r['wall_s']:.1f}s)")
    print(f"limit : {limit:8.1f} tok/s")
    summary = {
        "c_star": c_star, "curve": {str(c): round(v, 1) for c, v in curve.items()},
        "sync_tok_s": round(res["sync"]["tok_s"], 1), "april_tok_s": round(res["april"]["tok_s"], 1),
        "pool_tok_s": round(res["pool"]["tok_s"], 1), "limit_tok_s": round(limit, 1),
        "april_over_sync": round(res["april"]["tok_s"] / res["sync"]["tok_s"], 3),
        "april_over_limit": round(res["april"]["tok_s"] / limit, 3),
        "pool_over_limit": round(res["pool"]["tok_s"] / limit, 3),
        "off_policy_token_ratio": round(res["april"]["off_policy"], 4),
    }
    print(json.dumps(summary))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--limit-seconds", type=float, default=6.0, help="at least this long for the limit run")
    p.add_argument("--n", type=int, default=4, help="samples per prompt group")
    p.add_argument("--cap", type=int, default=128, help="Pareto cap on chain steps q (budget 3q tokens)")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--probe-seconds", type=float, default=4.0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("VERBOSE") else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="rollout_bench_") as workdir:
        asyncio.run(main_async(opts, workdir))


if __name__ == "__main__":
    sys.exit(main())
