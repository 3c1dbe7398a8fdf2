"""What a step of the embedded engine asks of the host: torch ops per step (each one a kernel launch or a view on a
GPU, where a small model's decode step is the host's time to issue them) and the step's thread CPU time here.

    python benchmarks/engine_step_ops.py [--layers 16] [--rows 1 128] [--resumed 60]

The model has the 0.5B preset's structure (16 layers, 16 query / 8 KV heads, tied embeddings) at a tiny width, so
what is timed is the host's work, not arithmetic. Two steps:
- a decode step of R rows: its torch ops per step and per layer (on CUDA transformers' RMSNorm modules are 8 of them
  each, 4 per layer, where the engine's fused `rms_norm` is one kernel: hf_engine/fused_norms.py; on the CPU torch
  runs the same ops inside `rms_norm`, so the count here is the same either way);
- the first step of a rollout step that resumes parked samples: 64 rows decoding beside `--resumed` prompts of 20-250
  tokens (as many shapes), with the GPU's masked prefill: one attention bucket per shape vs padded buckets
  (paged_attention.plan_buckets(merge_prefill=True)).
On the CPU the padded buckets cost more time (their padding is real arithmetic here): they pay on a GPU, where every
op is a launch of ~5-10 us and the padding's arithmetic is small. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import slime.backends.hf_engine.batch as batch_mod
from slime.backends.hf_engine import fused_norms
from slime.backends.hf_engine.batch import PagedBatch


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def tiny_model(layers: int):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=8, intermediate_size=128, max_position_embeddings=8192, head_dim=16,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def measure(fn, reps: int) -> tuple[int, float]:
    """(torch ops of one call, best thread CPU seconds over `reps` calls)."""
    count = OpCount()
    with count:
        fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return count.ops, best


def set_fused(model, on: bool) -> None:
    for m in fused_norms._candidates(model):
        if on:
            m.forward = types.MethodType(fused_norms._fused_forward, m)
        else:
            m.__dict__.pop("forward", None)


def decode_step(model, rows: int, fused: bool, reps: int) -> tuple[int, float]:
    set_fused(model, fused)
    b = PagedBatch(model, block_size=32, max_tokens=rows * 400 + 4096, max_rows=max(8, rows))
    rs = [b.add_row() for _ in range(rows)]
    for r in rs:
        b.forward([(r, [5] * 200, True)])
    return measure(lambda: b.forward([(r, [6], True) for r in rs]), reps)


def resume_step(model, resumed: int, merge: bool, reps: int) -> tuple[int, float, int]:
    set_fused(model, True)
    plan = batch_mod.plan_buckets
    batch_mod.plan_buckets = lambda *a, merge_prefill=False, **k: plan(*a, merge_prefill=merge, **k)
    try:
        rng = random.Random(0)
        lens = [rng.randint(20, 250) for _ in range(resumed)]
        made = []

        def step():  # a fresh batch each time: the prompts are prefilled again, not decoded
            b = PagedBatch(model, block_size=32, max_tokens=200000, max_rows=128, prefill_attention="masked")
            dec = [b.add_row() for _ in range(64)]
            for r in dec:
                b.forward([(r, [5] * 100, True)])
            new = [b.add_row() for _ in lens]
            segs = [(r, [6], True) for r in dec] + [(r, [7] * n, True) for r, n in zip(new, lens)]
            made.append((b, segs))

        ops = best = None
        count = OpCount()
        for rep in range(reps + 1):
            step()
            b, segs = made.pop()
            t0 = time.thread_time()
            if rep == 0:
                with count:
                    b.forward(segs)
            else:
                b.forward(segs)
                best = min(best or float("inf"), time.thread_time() - t0)
        ops = count.ops
        return ops, best, sum(1 for bk in b.last_plan.buckets if bk.q > 1)
    finally:
        batch_mod.plan_buckets = plan


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 128])
    p.add_argument("--resumed", type=int, default=60)
    p.add_argument("--reps", type=int, default=4, help="timed calls per case (best counts)")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = tiny_model(opts.layers)
    out = {"layers": opts.layers, "decode": {}, "resume": {}}
    for rows in opts.rows:
        ops, t = decode_step(model, rows, True, opts.reps)
        out["decode"][str(rows)] = {"ops": ops, "ops_per_layer": round(ops / opts.layers, 1), "cpu_ms": round(1e3 * t, 3)}
        print(f"decode, {rows:4d} rows: {ops:6d} torch ops ({ops / opts.layers:.0f} per layer), {1e3 * t:8.2f} ms "
              f"thread CPU", flush=True)
    for merge in (False, True):
        ops, t, buckets = resume_step(model, opts.resumed, merge, max(2, opts.reps // 2))
        out["resume"]["padded" if merge else "per_shape"] = {"ops": ops, "cpu_ms": round(1e3 * t, 3), "buckets": buckets}
        print(f"resume step, 64 decoding + {opts.resumed} prompts, {'padded buckets ' if merge else 'one per shape  '}: "
              f"{buckets:3d} prefill buckets, {ops:6d} torch ops, {1e3 * t:8.2f} ms thread CPU", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
