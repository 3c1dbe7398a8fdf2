"""The Megatron trainer's model-FLOP utilisation at a preset's shape, a few batching variants on one trainer, and a
profile of one train() saying where the GPU time goes (no Ray: the trainer runs in this process, world size 1).

    python benchmarks/trainer_mfu.py --model qwen3-0.5b --variants 16384 32768 65536 --profile --json OUT
    python benchmarks/trainer_mfu.py --model qwen3-4b-shape --layers auto --samples 32 --variants 8192 16384 ...

`--variants`: --max-tokens-per-gpu values (packed micro-batches, --use-dynamic-batch-size) taken in turn by ONE
trainer (what changes at train() time: the batching; what is fixed at start-up, e.g. --compile-ops or
--recompute-granularity, goes after `--` and is one run's). Per variant: a warm-up train(), then `--steps` timed
ones; MFU = 8 x N x T / time / peak (train_throughput.py: forward and backward of the update plus the old-log-prob
forward; attention's own FLOPs not counted). A variant that runs out of memory is a result and the next one runs.
`--layers auto`: as many of the preset's layers as the memory estimate (slime/utils/gpu_plan.py, within 15% of two
measured peaks) fits into 90% of the card at the largest variant. `--profile`: one more train() at the best variant
under torch.profiler (the device's kernels only; the measured variants are in --json before it starts): the top
kernels by GPU time, their share by kind (matmul, attention, element-wise, optimizer,
copies, communication) and the GPU's idle share of the wall time (the host's). Same command on CPU (the dry run).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import GPU_PEAK, MODELS, _params, build_model_dir, make_groups, trainer_args  # noqa: E402

KINDS = (("matmul", r"gemm|cutlass|nvjet|sm90_xmma|cublas|matmul|aten::(add|b)?mm\b"),
         ("attention", r"flash|fmha|attn|attention|sdpa"),
         ("optimizer", r"adam|multi_tensor|multitensor"), ("copy", r"memcpy|memset|copy|cat_|transpose"),
         ("communication", r"nccl|allreduce|all_gather|reduce_scatter"),
         ("element-wise", r"triton|elementwise|vectorized|reduce|softmax|norm|silu|mul|add|exp|log"))


def fit_layers(o, card_bytes: float, tokens: int) -> int:
    """The most of the preset's layers whose training memory (gpu_plan's estimate) fits 90% of the card."""
    from slime.utils.gpu_plan import estimate_memory
    from slime.utils.model_shape import ModelShape

    from transformers import Qwen3Config

    hidden, layers, heads, kv, head_dim, ffn, vocab, tied, max_pos = MODELS[o.model]
    config_only = os.path.join(o.root, f"{o.model}-config")  # what the flags' checks read, without weights
    os.makedirs(config_only, exist_ok=True)
    Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=tied,
                max_position_embeddings=max_pos).to_json_file(os.path.join(config_only, "config.json"))
    with open(os.path.join(config_only, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    args = trainer_args(o, config_only, "megatron", "packed", 0).replace(max_tokens_per_gpu=tokens)
    for n in range(layers, 0, -1):
        shape = ModelShape("qwen3", vocab, hidden, n, heads, kv, head_dim, ffn, 1e-6, 1e6, max_pos, tied, True,
                           False, 0.02, 0.0)
        if estimate_memory(args, shape, card_bytes).phases["training (trainer GPUs)"] <= 0.9 * card_bytes:
            return n
    raise SystemExit(f"--layers auto: not one layer of {o.model} fits {card_bytes / 2**30:.0f} GiB")


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, low)), "other")


def profile_one(trainer, groups, steps_done: int) -> dict:
    """One train() under torch.profiler: top kernels, share by kind, and the GPU's idle share of the wall time. On a
    GPU the device's kernels only: recording every host op too made the profiler's own bookkeeping outlast a GPU
    stage's minute (an H200, 2026-11-28: killed while collecting the trace, for 0.5B and for a 4B-shaped stack)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.train(steps_done, copy.deepcopy(groups), steps_done)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    rows = []
    for e in prof.key_averages():
        t = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6
        if t > 0 and (not cuda or str(e.device_type).endswith("CUDA")):  # kernels (not the ops that launched them)
            rows.append((t, e.key, e.count))
    rows.sort(reverse=True)
    busy = sum(t for t, _, _ in rows)
    by_kind: dict[str, float] = {}
    for t, name, _ in rows:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + t
    return {"wall_s": wall, "device_busy_s": busy, "idle_share": max(0.0, 1 - busy / wall) if cuda else None,
            "by_kind": {k: round(v / busy, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:160], "calls": c, "s": round(t, 5), "share": round(t / busy, 4)}
                    for t, n, c in rows[:15]]}


def save(o, out: dict) -> None:
    """--json: what was measured so far (rewritten after every variant and after the profile, so that a stage killed
    at its time cap keeps every figure it took)."""
    if o.json:
        with open(o.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(o.json + ".tmp", o.json)


def run(o) -> dict:
    import torch

    from slime.backends.megatron_utils.actor import MegatronTrainer

    cuda = torch.cuda.is_available()
    card = torch.cuda.get_device_properties(0).total_memory if cuda else o.card_gb * 2**30
    layers = fit_layers(o, card, max(o.variants)) if o.layers == "auto" else int(o.layers) if o.layers else None
    model_dir = build_model_dir(o.model, o.root, layers)
    base = trainer_args(o, model_dir, "megatron", "packed", 0)
    trainer = MegatronTrainer(base)
    out = {"model": o.model, "layers": layers or MODELS[o.model][1], "preset_layers": MODELS[o.model][1],
           "device": torch.cuda.get_device_name() if cuda else "cpu", "card_gb": round(card / 2**30, 1),
           "dtype": "bf16" if o.bf16 else "fp32", "extra_args": o.extra, "variants": []}
    peak = o.peak_tflops * 1e12 if o.peak_tflops else next((v for k, v in GPU_PEAK.items() if k in out["device"]), None)
    try:
        t0 = time.perf_counter()
        trainer.init()
        out["init_s"] = time.perf_counter() - t0
        n_params = sum(p.numel() for p in {id(p): p for p in _params(trainer)}.values())
        groups = make_groups(o)
        tokens = sum(len(s.tokens) for g in groups for s in g)
        out.update(params=n_params, tokens=tokens)
        step = 0
        for mt in o.variants:
            trainer.args = base.replace(max_tokens_per_gpu=mt)
            v = {"max_tokens_per_gpu": mt}
            try:
                times, peaks = [], []
                for i in range(o.steps + 1):  # the first is the warm-up
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    trainer.train(step, copy.deepcopy(groups), step)
                    if cuda:
                        torch.cuda.synchronize()
                        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
                    step += 1
                    if i:
                        times.append(time.perf_counter() - t0)
                dt = sorted(times)[len(times) // 2]
                v.update(train_s=dt, tokens_per_s=tokens / dt, tflops=8.0 * n_params * tokens / dt / 1e12,
                         mfu=8.0 * n_params * tokens / dt / peak if peak else None,
                         peak_gb=max(peaks) if peaks else None)
            except torch.OutOfMemoryError as e:
                v["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
            out["variants"].append(v)
            print(json.dumps(v), flush=True)
            save(o, out)
        done = [v for v in out["variants"] if "error" not in v]
        if o.profile and done:
            best = min(done, key=lambda v: v["train_s"])
            trainer.args = base.replace(max_tokens_per_gpu=best["max_tokens_per_gpu"])
            out["profile"] = {"max_tokens_per_gpu": best["max_tokens_per_gpu"], **profile_one(trainer, groups, step)}
            save(o, out)
    finally:
        trainer.shutdown()
    return out


def report(out: dict) -> None:
    print(f"\n{out['model']} ({out['layers']} of {out['preset_layers']} layers, {out.get('params', 0) / 1e9:.2f}B "
          f"parameters) on {out['device']}, {out.get('tokens')} tokens per train(), Megatron {out['dtype']}, packed"
          + (f", {' '.join(out['extra_args'])}" if out["extra_args"] else ""))
    for v in out["variants"]:
        if "error" in v:
            print(f"  max tokens per GPU {v['max_tokens_per_gpu']:>6}: {v['error']}")
            continue
        mfu = f"{100 * v['mfu']:.1f}%" if v.get("mfu") else "n/a"
        peak = f", peak {v['peak_gb']:.1f} GiB" if v.get("peak_gb") else ""
        print(f"  max tokens per GPU {v['max_tokens_per_gpu']:>6}: {v['train_s']:.3f} s per train(), "
              f"{v['tokens_per_s']:.0f} tok/s, {v['tflops']:.1f} TFLOP/s, MFU {mfu}{peak}")
    prof = out.get("profile")
    if prof:
        idle = f"{100 * prof['idle_share']:.0f}%" if prof["idle_share"] is not None else "n/a"
        print(f"  profile (max tokens {prof['max_tokens_per_gpu']}): GPU busy {prof['device_busy_s']:.3f} s of "
              f"{prof['wall_s']:.3f} s (idle {idle}); by kind: "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in prof["by_kind"].items()))
        for k in prof["top"][:10]:
            print(f"    {100 * k['share']:5.1f}%  {k['s']:.4f} s  x{k['calls']:<5} {k['name'][:110]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-0.5b")
    p.add_argument("--layers", default=None, help="'auto' (as many as fit) or a number (default: the preset's)")
    p.add_argument("--variants", type=int, nargs="+", default=[16384], help="--max-tokens-per-gpu values")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-min", type=int, default=768)
    p.add_argument("--response-max", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2, help="timed train() calls per variant after its warm-up")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--card-gb", type=float, default=80.0, help="the card's memory for --layers auto off a GPU")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "slime_train_throughput"))
    p.add_argument("--json", default=None)
    o, extra = p.parse_known_args(argv)
    o.extra = [x for x in extra if x != "--"]
    if o.samples % o.group_size:
        p.error("--samples must be a multiple of --group-size")
    import torch

    # what train_throughput.trainer_args reads: bf16 on a GPU (fp32 in the CPU dry run: its speed means nothing)
    o.bf16, o.micro_batch_size, o.global_batch_size, o.threads, o.seed = torch.cuda.is_available(), 1, None, 1, 0
    o.max_tokens_per_gpu = o.variants[0]
    os.makedirs(o.root, exist_ok=True)
    out = run(o)
    report(out)
    save(o, out)
    return 0 if any("error" not in v for v in out["variants"]) else 1


if __name__ == "__main__":
    sys.exit(main())
