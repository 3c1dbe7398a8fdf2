"""Trainer throughput and memory: tokens/s, peak memory and model-FLOP utilisation of one `train()`
per backend, padded vs packed micro-batches, by log-prob head chunk size, on RL-shaped lengths.

Same command on a CPU box and on a GPU (no Ray: the trainer classes run in-process, world size 1).
Each backend runs in a fresh subprocess (clean peak memory, clean process groups; `--in-process` to
save the start-up): one trainer, a warm-up `train()` per layout, then `--steps` rounds of one timed
`train()` per layout, padded and packed interleaved on the same weights and batch. Reported per run:
seconds per `train()` (median; and the old-log-prob part), tokens/s (prompt + response tokens), the
peak memory of a timed `train()` (GPU: `max_memory_allocated`; CPU: the process's peak resident
memory above what it held before the call), and MFU = 8 x N x T / time / peak FLOP/s (N parameters,
T tokens: forward + backward of the update plus the old-log-prob forward; peak: the GPU's dense bf16
rate, `--peak-tflops` elsewhere). Packed / padded ratios are printed side by side; the last line is
one JSON.

    python benchmarks/train_throughput.py                  # CPU: the small model, RL-shaped lengths (4x spread)
    python benchmarks/train_throughput.py --memory-check   # CPU acceptance: peak RSS at vocab 151,936
    python benchmarks/train_throughput.py --model qwen3-0.5b --bf16 --samples 64 --prompt-len 256 \
        --response-min 768 --response-max 2048 --max-tokens-per-gpu 16384    # the RL batch on a GPU

Lengths: `--samples` responses uniform in [--response-min, --response-max] (default 4x spread) after a
`--prompt-len` prompt; groups of `--group-size` with distinct rewards.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# model presets: (hidden, layers, heads, kv heads, head dim, ffn, vocab, tied, max positions)
MODELS = {
    "small": (256, 4, 4, 2, 64, 768, 4096, False, 40960),
    "tiny": (64, 2, 4, 2, 16, 128, 151936, False, 40960),
    "tiny-small-vocab": (64, 2, 4, 2, 16, 128, 512, False, 40960),
    "qwen3-0.5b": (1024, 16, 16, 8, 128, 3072, 151936, True, 40960),
    "qwen3-4b-shape": (2560, 36, 32, 8, 128, 9728, 151936, True, 40960),  # Qwen3-4B's layer and vocabulary
}
# dense bf16 tensor-core peak (no sparsity), FLOP/s
GPU_PEAK = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "MI300": 1307e12}


def build_model_dir(preset: str, root: str, layers: int | None = None) -> str:
    """The preset's random model in `root` (reused when there), with `layers` instead of the preset's."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.utils.tiny_model import build_tokenizer

    hidden, preset_layers, heads, kv, head_dim, ffn, vocab, tied, max_pos = MODELS[preset]
    layers = layers or preset_layers
    path = os.path.join(root, preset if layers == preset_layers else f"{preset}-{layers}l")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = build_tokenizer(list("0123456789+-="))
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=tied,
                      max_position_embeddings=max_pos, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      dtype="bfloat16" if hidden >= 512 else "float32", bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg)
    if hidden >= 512:
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    return path


def make_groups(o):
    from slime.utils.types import Sample, Status

    rng = random.Random(o.seed)
    vocab = MODELS[o.model][6]
    groups, idx = [], 0
    for g in range(o.samples // o.group_size):
        prompt = [1] + [rng.randrange(3, min(vocab, 4000)) for _ in range(o.prompt_len - 1)]
        group = []
        for j in range(o.group_size):
            n = rng.randint(o.response_min, o.response_max)
            resp = [rng.randrange(3, min(vocab, 4000)) for _ in range(n)]
            s = Sample(index=idx, group_index=g, tokens=list(prompt))
            s.append_response(resp, [-2.0] * n, 0)
            s.reward = float(j % 2) + 0.1 * j
            s.status = Status.COMPLETED
            group.append(s)
            idx += 1
        groups.append(group)
    return groups


def trainer_args(o, model_dir: str, backend: str, layout: str, chunk: int):
    from slime.arguments import parse_args

    argv = ["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(model_dir, "prompts.jsonl"), "--rm-type",
            "math", "--num-rollout", "1", "--rollout-batch-size", str(o.samples // o.group_size),
            "--n-samples-per-prompt", str(o.group_size), "--global-batch-size", str(o.global_batch_size or o.samples),
            "--micro-batch-size", str(o.micro_batch_size), "--lr", "1e-6", "--train-backend", backend,
            "--micro-batch-layout", layout, "--log-probs-chunk-size", str(chunk), "--calculate-per-token-loss",
            "--train-num-threads", str(o.threads), "--seed", "1"]
    if o.max_tokens_per_gpu:
        argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(o.max_tokens_per_gpu)]
    # what the measurement says it is: fp32 unless --bf16 (the trainer's own default is bf16 on GPUs), and the
    # distributed optimizer only with bf16 (the measured configurations)
    argv += ["--bf16" if o.bf16 else "--no-bf16"]
    if backend == "megatron":
        argv += ["--use-distributed-optimizer" if o.bf16 else "--no-use-distributed-optimizer",
                 "--no-accumulate-allreduce-grads-in-fp32"]
    return parse_args(argv + o.extra)


def run_backend(o, backend: str, layouts: list[str], chunk: int) -> list[dict]:
    """In this process: one trainer; a warm-up train() per layout, then `--steps` rounds of one timed train() per
    layout, the layouts interleaved (the same weights, and the box's drift hits them alike)."""
    import torch

    from slime.backends.training_utils.distributed import compile_ops
    from slime.utils.peak_memory import PeakRSS

    model_dir = build_model_dir(o.model, o.root)
    base = trainer_args(o, model_dir, backend, layouts[0], chunk)
    if backend == "fsdp":
        from slime.backends.fsdp_utils.actor import FSDPTrainer as cls
    else:
        from slime.backends.megatron_utils.actor import MegatronTrainer as cls
    cuda = torch.cuda.is_available()
    trainer = cls(base)
    runs = {lay: {"times": [], "old": [], "rises": [], "peaks": []} for lay in layouts}
    try:
        t_init = time.perf_counter()
        trainer.init()
        init_s = time.perf_counter() - t_init
        n_params = sum(p.numel() for p in {id(p): p for p in _params(trainer)}.values())
        groups = make_groups(o)
        tokens = sum(len(s.tokens) for g in groups for s in g)
        for lay in layouts:  # warm-up (and, with --compile-ops, the kernels' compilation)
            trainer.args = base.replace(micro_batch_layout=lay)
            trainer.train(0, copy.deepcopy(groups), 0)
        head_diff = fused_head_diff(trainer, base, groups, o.check_fused_head) if o.check_fused_head else None
        waited = wait_for_file(o.wait_for_file, o.wait_for_timeout) if o.wait_for_file else 0.0
        for step in range(o.steps):
            for lay in layouts[step % len(layouts):] + layouts[: step % len(layouts)]:
                trainer.args = base.replace(micro_batch_layout=lay)  # the same model, the other layout
                r = runs[lay]
                batch = copy.deepcopy(groups)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                with PeakRSS() as rss:
                    t0 = time.perf_counter()
                    m = trainer.train(step + 1, batch, step + 1)
                    if cuda:
                        torch.cuda.synchronize()
                    r["times"].append(time.perf_counter() - t0)
                r["old"].append(m["old_logprob_time_s"])
                r["rises"].append(rss.rise)
                if cuda:
                    r["peaks"].append(torch.cuda.max_memory_allocated())
    finally:
        trainer.shutdown()
    peak = o.peak_tflops * 1e12 if o.peak_tflops else _gpu_peak() if cuda else None
    flops = 8.0 * n_params * tokens
    out = []
    for lay in layouts:
        r = runs[lay]
        dt = sorted(r["times"])[len(r["times"]) // 2]
        out.append({"backend": backend, "layout": lay, "chunk": chunk, "device": _device_name(), "params": n_params,
                    "tokens": tokens, "samples": o.samples, "init_s": init_s, "train_s": dt, "train_s_all": r["times"],
                    "old_logprob_s": sorted(r["old"])[len(r["old"]) // 2], "tokens_per_s": tokens / dt,
                    "tflops": flops / dt / 1e12, "mfu": (flops / dt / peak) if peak else None,
                    "rss_rise_gb": max(r["rises"]) / 2**30,
                    "gpu_peak_gb": (max(r["peaks"]) / 2**30) if r["peaks"] else None, "bf16": bool(o.bf16),
                    "compile_ops": compile_ops(base), "fused_head_max_diff": head_diff, "waited_s": waited})
    return out


def fused_head_diff(trainer, args, groups, n: int) -> float | None:
    """Max |log-prob| difference between the fused (compiled) head and the eager one on the first `n` samples,
    same weights, same body (the head alone switches with --compile-ops at each forward); None when the
    trainer does not fuse."""
    from slime.backends.training_utils.data import flatten_groups
    from slime.backends.training_utils.distributed import compile_ops

    if not compile_ops(args):
        return None
    items = [it for g in flatten_groups(copy.deepcopy(groups))[0] for it in g][:n]
    for i, it in enumerate(items):
        it.pos = i
    trainer.args = args
    fused = trainer._log_probs(trainer._actor, items)
    trainer.args = args.replace(compile_ops="off")
    try:
        eager = trainer._log_probs(trainer._actor, items)
    finally:
        trainer.args = args
    return max(float((a - b).abs().max()) for a, b in zip(fused, eager))


def wait_for_file(path: str, timeout: float) -> float:
    """Until `path` exists (other work on the GPU has finished) or `timeout` seconds; returns the wait."""
    t0 = time.perf_counter()
    while not os.path.exists(path) and time.perf_counter() - t0 < timeout:
        time.sleep(0.2)
    if not os.path.exists(path):
        print(f"--wait-for-file {path}: not there after {timeout:.0f} s; timing anyway", file=sys.stderr)
    return time.perf_counter() - t0


def _params(trainer):
    if hasattr(trainer, "actor") and trainer.actor is not None:
        return list(trainer.actor.core.parameters())
    return list(trainer.model.parameters())


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _gpu_peak() -> float | None:
    name = _device_name()
    return next((v for k, v in GPU_PEAK.items() if k in name), None)


def run_caught(o, backend: str, layouts: list[str], chunk: int) -> list[dict]:
    """`run_backend` in this process; a failure (out of memory, ...) is a result, and the next run goes on."""
    import gc
    import traceback

    import torch

    try:
        return run_backend(o, backend, layouts, chunk)
    except Exception:  # noqa: BLE001  (reported in the results, like a failed subprocess)
        err = traceback.format_exc()[-3000:]
        return [{"backend": backend, "layout": lay, "chunk": chunk, "error": err} for lay in layouts]
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_isolated(o, argv: list[str], backend: str, layouts: list[str], chunk: int) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--one", f"{backend}:{','.join(layouts)}:{chunk}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=o.timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("[")]
    if out.returncode != 0 or not lines:
        err = (out.stderr or out.stdout)[-3000:]
        return [{"backend": backend, "layout": lay, "chunk": chunk, "error": err} for lay in layouts]
    return json.loads(lines[-1])


def print_table(results: list[dict]) -> None:
    print(f"{'backend':<9}{'layout':<8}{'chunk':>7}{'s/train':>9}{'old lp s':>9}{'tok/s':>10}{'TFLOP/s':>9}"
          f"{'MFU':>7}{'RSS+ GB':>9}{'GPU GB':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['backend']:<9}{r['layout']:<8}{r['chunk']:>7}  FAILED: {r['error'].strip().splitlines()[-1]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
        gpu = f"{r['gpu_peak_gb']:.2f}" if r.get("gpu_peak_gb") is not None else "-"
        print(f"{r['backend']:<9}{r['layout']:<8}{r['chunk']:>7}{r['train_s']:>9.3f}{r['old_logprob_s']:>9.3f}"
              f"{r['tokens_per_s']:>10.0f}{r['tflops']:>9.2f}{mfu:>7}{r['rss_rise_gb']:>9.3f}{gpu:>8}")
    ok = [r for r in results if "error" not in r]
    for b in sorted({r["backend"] for r in ok}):
        for c in sorted({r["chunk"] for r in ok}):
            by = {r["layout"]: r for r in ok if r["backend"] == b and r["chunk"] == c}
            if "padded" in by and "packed" in by:
                print(f"{b} chunk {c}: packed / padded time per train() = "
                      f"{by['packed']['train_s'] / by['padded']['train_s']:.2f}x "
                      f"({by['packed']['train_s']:.3f} s vs {by['padded']['train_s']:.3f} s)")
    for c in sorted({r["chunk"] for r in ok}):
        bks = {r["backend"]: r for r in ok if r["layout"] == "packed" and r["chunk"] == c}
        if "fsdp" in bks and "megatron" in bks:
            print(f"chunk {c}: fsdp / megatron time per train() (packed): "
                  f"{bks['fsdp']['train_s'] / bks['megatron']['train_s']:.2f}x")


def save(o, results: list[dict]) -> None:
    if o.json:
        with open(o.json, "w") as f:
            json.dump({"model": o.model, "results": results}, f, indent=1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="small",
                   help="small: body-dominated CPU model; tiny: tiny hidden size, Qwen's 151,936-token vocabulary; "
                        "qwen3-0.5b: the GPU shape (hidden 1024, 16 layers, tied)")
    p.add_argument("--backends", nargs="+", default=["fsdp", "megatron"], choices=["fsdp", "megatron"])
    p.add_argument("--layouts", nargs="+", default=["padded", "packed"], choices=["padded", "packed"])
    p.add_argument("--configs", nargs="+", default=None, metavar="BACKEND:LAYOUT",
                   help="exactly these runs, in this order (instead of every backend x layout)")
    p.add_argument("--chunk-sizes", nargs="+", type=int, default=[0],
                   help="--log-probs-chunk-size values (0 auto, -1 none)")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-min", type=int, default=64)
    p.add_argument("--response-max", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--max-tokens-per-gpu", type=int, default=None,
                   help="--use-dynamic-batch-size with this token budget (instead of --micro-batch-size)")
    p.add_argument("--global-batch-size", type=int, default=None, help="default: --samples (one optimizer step)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=2, help="timed train() calls after the warm-up")
    p.add_argument("--threads", type=int, default=1, help="--train-num-threads (CPU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU where the GPU is not known")
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "slime_train_throughput"),
                   help="where the random models are written (reused)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--in-process", action="store_true", help="all runs in this process (faster start, shared peaks)")
    p.add_argument("--memory-check", action="store_true",
                   help="CPU acceptance: 2 samples of 1,024 then 2,048 tokens, micro-batch 1, model tiny, both "
                        "backends, packed: the peak RSS rise of one train() (bounds 0.5 / 0.6 GB)")
    p.add_argument("--check-fused-head", type=int, default=0, metavar="N",
                   help="after the warm-up, the max |log-prob| difference between the fused (--compile-ops) head and "
                        "the eager one on the first N samples (0: not measured)")
    p.add_argument("--wait-for-file", default=None, metavar="PATH",
                   help="the timed train() calls start only once PATH exists (e.g. tests sharing the GPU during the "
                        "warm-up have finished), or after --wait-for-timeout seconds")
    p.add_argument("--wait-for-timeout", type=float, default=120.0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    o, extra = p.parse_known_args(argv)
    o.extra = [x for x in extra if x != "--"]
    if o.samples % o.group_size:
        p.error("--samples must be a multiple of --group-size")
    return o


def main(argv=None) -> int:
    import logging

    argv = list(sys.argv[1:] if argv is None else argv)
    o = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    if o.one:
        backend, layouts, chunk = o.one.split(":")
        print(json.dumps(run_backend(o, backend, layouts.split(","), int(chunk))))
        return 0
    os.makedirs(o.root, exist_ok=True)
    build_model_dir(o.model, o.root)
    results = []
    if o.memory_check:
        for total in (1024, 2048):
            sub = [*argv, "--model", "tiny", "--samples", "2", "--group-size", "2", "--prompt-len", "16", "--response-min",
                   str(total - 16), "--response-max", str(total - 16), "--micro-batch-size", "1", "--steps", "1",
                   "--layouts", "packed"]
            so = parse(sub)
            for b in so.backends:
                r = (run_caught(so, b, ["packed"], 0) if o.in_process else run_isolated(so, sub, b, ["packed"], 0))[0]
                r["tokens_per_sample"] = total
                results.append(r)
                if "error" not in r:
                    bound = 0.5 if total == 1024 else 0.6
                    print(f"{b:<9} 2 x {total} tokens, vocab {MODELS[so.model][6]}: peak RSS +{r['rss_rise_gb']:.3f} GB "
                          f"(bound {bound} GB) {'ok' if r['rss_rise_gb'] <= bound else 'OVER'}")
                else:
                    print(f"{b}: FAILED {r['error'][-2000:]}")
    else:
        # interleave configurations so the box's drift hits them alike
        # one trainer per backend (consecutive --configs of one backend share it), its layouts interleaved
        runs: list[tuple[str, list[str]]] = []
        for c in (o.configs or [f"{b}:{lay}" for b in o.backends for lay in o.layouts]):
            backend, layout = c.split(":")
            if runs and runs[-1][0] == backend:
                runs[-1][1].append(layout)
            else:
                runs.append((backend, [layout]))
        for chunk in o.chunk_sizes:
            for backend, layouts in runs:
                rs = (run_caught(o, backend, layouts, chunk) if o.in_process
                      else run_isolated(o, argv, backend, layouts, chunk))
                results += rs
                for r in rs:
                    print(json.dumps({k: v for k, v in r.items() if k != "train_s_all"}), file=sys.stderr)
                save(o, results)  # so far: a run cut short by a time limit still leaves what it measured
        print_table(results)
    save(o, results)
    print(json.dumps({"model": o.model, "results": results}))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
