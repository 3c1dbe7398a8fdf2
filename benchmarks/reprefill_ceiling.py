"""What re-prefilling after every weight update costs on this engine: the ceiling of pool mode without
stale KV, measured in-process (the scheduler driven directly: no HTTP, no drain, no abort latency, the
engine always full), in thread CPU time so that a shared box's load does not move it.

Two runs of the same long-tailed workload as benchmarks/rollout_throughput.py (budgets --scale x q,
q ~ truncated Pareto) with --concurrency samples always in flight, stepped in lockstep (one engine step
of each in turn):
- the limit: nothing ever interrupts a sample;
- step boundaries: each time --per-step samples have finished, every in-flight sample is aborted, the
  cache flushed (a weight update's default) and the sample resumed from its tokens, as pool mode does.
It prints tokens per CPU-second of both, their ratio (the ceiling), the prefilled tokens per generated
token, and what the two cost per token.

    python benchmarks/reprefill_ceiling.py [--warmup-steps 3000] [--steps 4000]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch

from slime.backends.hf_engine.sampling import SamplingParams
from slime.backends.hf_engine.scheduler import Request, Scheduler
from slime.tasks.subtract_chain import VOCAB, sample_steps
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer


class Run:
    """One scheduler driven step by step over the workload; `step()` returns its thread CPU seconds."""

    def __init__(self, model, tok, opts, boundaries: bool):
        self.opts, self.boundaries, self.rng, self.tok = opts, boundaries, random.Random(opts.seed), tok
        self.sched = Scheduler(model, tok, max_running=opts.concurrency, max_total_tokens=1 << 22,
                               max_prefill_tokens=8192, seed=0, chunked_prefill_size=512, block_size=32,
                               prefix_cache_tokens=0)
        self.count = 0
        self.live = [self.fresh() for _ in range(opts.concurrency)]
        self.finished_in_step = 0
        self.cpu, self.snap = 0.0, None

    def submit(self, ids: list[int], budget: int) -> Request:
        r = Request(f"r{self.count}", ids, SamplingParams(max_new_tokens=budget, temperature=1.0, ignore_eos=True))
        self.count += 1
        self.sched._add(r)
        return r

    def fresh(self) -> Request:
        prompt = [1] + [self.rng.randrange(3, len(self.tok)) for _ in range(5)]
        return self.submit(prompt, self.opts.scale * sample_steps(self.rng, cap=self.opts.cap))

    def start_measuring(self) -> None:
        self.snap, self.cpu = self.sched.stats.as_dict(), 0.0

    def step(self) -> None:
        t0 = time.thread_time()
        self.sched._admit()
        self.sched._step()
        for i, r in enumerate(self.live):
            if r.finished:
                self.finished_in_step += 1
                self.live[i] = self.fresh()
        if self.boundaries and self.finished_in_step >= self.opts.per_step:
            self.finished_in_step = 0
            self.sched.abort(None, "step boundary")  # its KV is dropped with the cache: a weight update
            self.live = [self.submit(r.input_ids + r.output_ids, r.params.max_new_tokens - len(r.output_ids))
                         for r in self.live]
        self.cpu += time.thread_time() - t0

    def measured(self) -> dict:
        return {k: v - self.snap[k] for k, v in self.sched.stats.as_dict().items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--per-step", type=int, default=128, help="samples finished per step (B groups x n)")
    p.add_argument("--scale", type=int, default=24)
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--warmup-steps", type=int, default=3000, help="engine steps before measuring (the steady state)")
    p.add_argument("--steps", type=int, default=4000, help="engine steps measured")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="reprefill_") as tmp:
        spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=2 * opts.hidden,
                             max_position_embeddings=opts.scale * opts.cap + 64)
        build_tiny_qwen3(tmp, build_tokenizer(VOCAB), spec, seed=0)
        model = AutoModelForCausalLM.from_pretrained(tmp).eval()
        tok = AutoTokenizer.from_pretrained(tmp)
        # both in lockstep, one engine step each in turn, so the box's load drifts hit both alike
        runs = {"limit": Run(model, tok, opts, False), "boundaries": Run(model, tok, opts, True)}
        for i in range(opts.warmup_steps + opts.steps):
            if i == opts.warmup_steps:
                for r in runs.values():
                    r.start_measuring()
            for r in runs.values():
                r.step()
        res = {}
        for name, r in runs.items():
            d = r.measured()
            res[name] = (d, r.cpu)
            rows = (d["decode_rows"] + d["prefill_decode_rows"]) / max(1, d["decode_steps"] + d["prefills"])
            print(f"{name:10s}: {d['sampled_tokens'] / r.cpu:8.0f} tok per CPU-second; "
                  f"{d['prefill_tokens'] / d['sampled_tokens']:.2f} prefilled tokens per generated token; "
                  f"{rows:.1f} rows per step", flush=True)
    (dl, cl), (db, cb) = res["limit"], res["boundaries"]
    ceiling = (db["sampled_tokens"] / cb) / (dl["sampled_tokens"] / cl)
    per_decode = cl / dl["sampled_tokens"]
    # the boundaries run's extra CPU over the limit's cost for its tokens is the re-prefill
    per_prefill = (cb - per_decode * db["sampled_tokens"]) / max(1, db["prefill_tokens"] - dl["prefill_tokens"])
    r = db["prefill_tokens"] / db["sampled_tokens"]
    print(f"ceiling of pool mode without stale KV here: {ceiling:.3f} x the limit; a generated token costs "
          f"{1e6 * per_decode:.1f} us, a re-prefilled one ~{1e6 * per_prefill:.1f} us ({per_prefill / per_decode:.3f} of it); "
          f"at a GPU's ~1/100 the same re-prefill would leave {1 / (1 + r / 100):.3f}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
