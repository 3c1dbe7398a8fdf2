"""Prepare the embedded `subtract_chain` quick start: data, tokenizer, tiny Qwen3 and its supervised warm start.

    python tools/prepare_tiny_task.py --out runs/tiny
    python tools/prepare_tiny_task.py --out runs/tiny-tool --task subtract_tool   # the agentic quick start

With `--task subtract_tool` (slime/tasks/subtract_tool.py) the vocabulary has the calculator's call markers,
chains are capped at 24 steps, and the warm start imitates a teacher that calls the calculator on `--p-call`
of the steps (observations out of its loss); its accuracy and tool use are measured with the calculator in
the loop.

writes
    OUT/train.jsonl, OUT/eval.jsonl   rows {"prompt", "label", "metadata"} (--input-key prompt --label-key label)
    OUT/model-init/                   the randomly initialised tiny Qwen3 + tokenizer (HF directory)
    OUT/model-sft/                    the warm-started model (HF directory) + warm_start.json (accuracy, timing, cache key)

A second run with the same settings finds OUT/model-sft/warm_start.json with a
matching key and skips the work.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import sys
import time

logger = logging.getLogger("prepare_tiny_task")

SUMMARY_FILE = "warm_start.json"


def parse_cli(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--train-size", type=int, default=20000, help="rows in train.jsonl")
    p.add_argument("--eval-size", type=int, default=512, help="rows in eval.jsonl (fixed eval set)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=["subtract_chain", "subtract_tool"], default="subtract_chain",
                   help="subtract_tool: the agentic variant, with a calculator the model may call")
    p.add_argument("--p-call", type=float, default=None,
                   help="subtract_tool: share of steps on which the warm start's teacher calls the calculator")
    p.add_argument("--cap", type=int, default=None,
                   help="maximum number of chain steps (default 64; 24 for subtract_tool, whose calls cost 9 tokens a step)")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of the number of steps")
    p.add_argument("--sft-steps", type=int, default=None, help="supervised warm-start steps (batches)")
    p.add_argument("--sft-seconds", type=float, default=None, help="wall-clock cap on the warm start")
    p.add_argument("--sft-lr", type=float, default=None, help="peak AdamW learning rate (cosine decay)")
    p.add_argument("--sft-batch-size", type=int, default=None)
    p.add_argument("--teacher-p", type=float, default=None, help="per-step error probability of the noisy teacher")
    p.add_argument("--hidden-size", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 beats 2 on a contended 2-core box)")
    p.add_argument("--skip-eval", action="store_true", help="do not measure the warm start's accuracy")
    p.add_argument("--force", action="store_true", help="redo the warm start even if the cache matches")
    return p.parse_args(argv)


def _config(a):
    from slime.tasks.tool_warm_start import ToolWarmStartConfig
    from slime.tasks.warm_start import WarmStartConfig

    overrides = {
        "seed": a.seed,
        "cap": a.cap,
        "alpha": a.alpha,
        "threads": a.threads,
        "max_steps": a.sft_steps,
        "max_seconds": a.sft_seconds,
        "lr": a.sft_lr,
        "batch_size": a.sft_batch_size,
        "teacher_p": a.teacher_p,
        "hidden_size": a.hidden_size,
        "num_layers": a.num_layers,
    }
    if a.task == "subtract_tool":
        overrides["p_call"] = a.p_call
        return ToolWarmStartConfig(**{k: v for k, v in overrides.items() if v is not None})
    if a.p_call is not None:
        raise SystemExit("--p-call is for --task subtract_tool")
    return WarmStartConfig(**{k: v for k, v in overrides.items() if v is not None})


def cache_key(a, cfg) -> str:
    key = {"warm_start": json.loads(cfg.key()), "train_size": a.train_size, "eval_size": a.eval_size}
    if a.task != "subtract_chain":  # (the quick start's existing caches keep their key)
        key["task"] = a.task
    return json.dumps(key, sort_keys=True)


def prepare(a) -> dict:
    import torch

    import random

    from slime.tasks import subtract_chain, subtract_tool
    from slime.tasks.tool_warm_start import evaluate_with_tools, teacher_batches
    from slime.tasks.warm_start import evaluate, train_warm_start
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    agentic = a.task == "subtract_tool"
    task = subtract_tool if agentic else subtract_chain
    cfg = _config(a)
    key = cache_key(a, cfg)
    out = os.path.abspath(a.out)
    sft_dir = os.path.join(out, "model-sft")
    summary_path = os.path.join(sft_dir, SUMMARY_FILE)
    if not a.force and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        if summary.get("key") == key and all(os.path.exists(os.path.join(out, n)) for n in ("train.jsonl", "eval.jsonl")):
            logger.info("warm start cached in %s (same settings); skipping", sft_dir)
            summary["cached"] = True
            return summary
        logger.info("settings differ from %s; redoing the warm start", summary_path)

    torch.set_num_threads(cfg.threads)
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    # Distinct seeds for train and eval rows; the eval set is fixed for a given --seed.
    task.write_dataset(os.path.join(out, "train.jsonl"), a.train_size, seed=a.seed * 1000 + 1, cap=cfg.cap, alpha=cfg.alpha)
    task.write_dataset(os.path.join(out, "eval.jsonl"), a.eval_size, seed=a.seed * 1000 + 2, cap=cfg.cap, alpha=cfg.alpha)

    tokenizer = build_tokenizer(task.VOCAB)
    spec = TinyQwen3Spec(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=max(256, (9 if agentic else 4) * cfg.cap + 16),
    )
    model = build_tiny_qwen3(os.path.join(out, "model-init"), tokenizer, spec, seed=cfg.seed)
    batches = teacher_batches(cfg, tokenizer, random.Random(cfg.seed + 1)) if agentic else None
    history = train_warm_start(model, tokenizer, cfg, batches=batches)

    summary = {
        "key": key,
        "num_params": sum(p.numel() for p in model.parameters()),
        "sft_steps": history["steps"],
        "sft_seconds": round(history["train_seconds"], 1),
        "sft_cpu_seconds": round(history["cpu_seconds"], 1),
        "final_loss": round(history["final_loss"], 4),
    }
    if not a.skip_eval:
        t0 = time.perf_counter()
        rows = task.read_dataset(os.path.join(out, "eval.jsonl"))
        for name, temp in (("t1", 1.0), ("greedy", 0.0)):
            if agentic:
                res = evaluate_with_tools(model, tokenizer, rows, temperature=temp, seed=a.seed)
                summary[f"eval_accuracy_{name}"] = round(res["accuracy"], 4)
                summary[f"eval_tool_calls_per_sample_{name}"] = round(res["calls_per_sample"], 3)
                summary[f"eval_tool_call_share_{name}"] = round(res["call_share"], 3)
                continue
            res = evaluate(model, tokenizer, rows, temperature=temp, seed=a.seed)
            summary[f"eval_accuracy_{name}"] = round(res["accuracy"], 4)
            summary[f"eval_accuracy_long_{name}"] = round(res["accuracy_long"], 4)
        summary["eval_seconds"] = round(time.perf_counter() - t0, 1)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 1)

    tmp_dir = sft_dir + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, SUMMARY_FILE), "w") as f:
        json.dump(summary, f, indent=1)
    shutil.rmtree(sft_dir, ignore_errors=True)
    os.replace(tmp_dir, sft_dir)
    summary["cached"] = False
    return summary


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_cli(argv)
    for name in ("train_size", "eval_size"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    out = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent callers (the test suite's workers) build it once
        summary = prepare(a)
    print(json.dumps({k: v for k, v in summary.items() if k != "key"}, indent=1))  # CLI summary
    return 0


if __name__ == "__main__":
    sys.exit(main())
