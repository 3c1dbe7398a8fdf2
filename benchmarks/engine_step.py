"""The embedded engine's decode step at 1, 8, 64 and 128 rows: the flat cost APRIL relies on, on the engine's device.

    python benchmarks/engine_step.py [--model qwen3-0.5b | quickstart] [--rows 1 8 64 128] [--context 512]
        [--seconds 2] [--warmup 0.5] [--windows 3] [--device auto] [--cuda-graph-mode auto] [--memory-check]
        [--model-cache DIR] [--json-out FILE]

The model is a preset of `slime.utils.tiny_model.model_preset` (random weights): `qwen3-0.5b` (Qwen3-0.6B's width,
heads and vocabulary, 16 layers, bfloat16 on a GPU) or `quickstart` (the quick start's tiny Qwen3). For each row
count R, R requests with prompts of `--context` random tokens (`ignore_eos`, temperature 1, log-probs: as a
rollout asks) are sent at once; once the engine's counters show decode-only steps of exactly R rows and they
decoded for `--warmup` seconds, the step time is the median over `--windows` windows of `--seconds` in all (every
row count first runs briefly once: each batch size has kernels of its own to load); then every request is
aborted. Printed per R: ms per step; the part of it until the step's work was issued (on a GPU, launch ~ step with
a short read-back means the device waited for the host: a launch-bound step, what CUDA graphs would shorten; a
full launch queue would show as a long read-back instead; on the CPU the two are equal); tokens/s; the step time
over 1 row's. `--memory-check` then releases the engine's memory (/release_memory_occupation, weights kept in host
memory) and prints what the device got back, resumes it and checks that greedy tokens are unchanged.
`--cuda-graph-mode` is the engine's (auto: decode steps replay CUDA graphs on a GPU; off: eager): the JSON holds
the greedy tokens of one prompt alone and of 5 prompts sent together (padded to 8 rows by the graphs), so two runs,
one per mode, show whether the graphs change a token (benchmarks/gpu_main_job.sh compares them).
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

import aiohttp

from slime.backends.hf_engine.local_server import EngineServer
from slime.backends.sglang_utils import http_client
from slime.rollout.simulator.probes import generate_one, random_ids, requests_in_flight, scheduler_stats, stats_delta
from slime.tasks.subtract_chain import VOCAB
from slime.utils.tiny_model import build_preset, build_tokenizer, model_preset

FLAT_LIMIT = 2.0  # the acceptance: a step at 128 rows within 2x of a step at 1 row


async def wait_idle(session, url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await requests_in_flight(session, url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: requests still in flight {timeout:.0f}s after the abort")
        await asyncio.sleep(0.02)


async def step_time(session, url: str, rows: int, prompt_len: int, new_tokens: int, seconds: float,
                    rng: random.Random, vocab: int, min_steps: int = 10, warmup: float = 0.0, windows: int = 1,
                    strict: bool = True) -> dict | None:
    """Decode-step time with `rows` rows decoding together (the engine's own counters): after `warmup` seconds of
    them, the median of `windows` windows over `seconds` (a one-off slow step, e.g. a first kernel load, moves the
    mean of one window, not the median of several)."""
    tasks = [asyncio.create_task(generate_one(session, url, random_ids(rng, vocab, prompt_len), new_tokens))
             for _ in range(rows)]
    base = await scheduler_stats(session, url)
    deadline = time.monotonic() + 120
    while True:  # until every row decodes: two decode-only steps of exactly `rows` rows since the last prefill seen
        await asyncio.sleep(0.05)
        cur = await scheduler_stats(session, url)
        d = stats_delta(cur, base)
        if d["prefills"] or d["decode_rows"] != rows * d["decode_steps"]:
            base = cur  # rows still joining: look again from here
        elif d["decode_steps"] >= 2:
            break
        if time.monotonic() > deadline or all(t.done() for t in tasks):
            raise RuntimeError(f"{rows} rows never decoded together (last poll: {d})")
    # the rows stop after `new_tokens`: a short context (the quick start's model) leaves less than warm-up + window
    left = 0.8 * (new_tokens - d["decode_steps"] - 2) * d["decode_s"] / max(1, d["decode_steps"])
    if warmup + seconds > left:
        warmup, seconds = max(0.0, min(warmup, left - seconds)), min(seconds, max(left, 0.05))
    if warmup > 0:
        await asyncio.sleep(warmup)
        cur = await scheduler_stats(session, url)
    parts = []
    for _ in range(max(1, windows)):
        await asyncio.sleep(seconds / max(1, windows))
        now = await scheduler_stats(session, url)
        parts.append(stats_delta(now, cur))
        cur = now
    d = {k: sum(p.get(k, 0) for p in parts) for k in parts[0]}
    while d["decode_steps"] < min_steps and not all(t.done() for t in tasks):  # a slow step: a few more of them
        await asyncio.sleep(0.1)
        now = await scheduler_stats(session, url)
        extra = stats_delta(now, cur)
        parts[-1] = {k: parts[-1].get(k, 0) + v for k, v in extra.items()}
        d = {k: d.get(k, 0) + v for k, v in extra.items()}
        cur = now
    await http_client.post(session, url, "/abort_request", {"abort_all": True}, timeout=30)
    await asyncio.gather(*tasks)
    await wait_idle(session, url)
    steps = d["decode_steps"]
    if not strict:  # a warm-up pass: what it measured does not matter
        return None
    if steps < min_steps or d["decode_rows"] != rows * steps:
        raise RuntimeError(f"{rows} rows: the window saw {steps} steps of {d['decode_rows'] / max(1, steps):.1f} rows "
                           f"(--new-tokens too few for {min_steps} steps?)")
    per = sorted((p["decode_s"] / p["decode_steps"], p) for p in parts if p.get("decode_steps"))
    mid = per[(len(per) - 1) // 2][1]  # the median window
    return {"rows": rows, "steps": steps, "step_ms": 1000 * mid["decode_s"] / mid["decode_steps"],
            "mean_step_ms": 1000 * d["decode_s"] / steps,
            "window_ms": [round(1000 * p["decode_s"] / p["decode_steps"], 3) for p in parts if p.get("decode_steps")],
            "launch_ms": 1000 * mid.get("decode_launch_s", mid["decode_s"]) / mid["decode_steps"],
            "cpu_ms": 1000 * mid.get("decode_cpu_s", 0.0) / mid["decode_steps"],
            "tok_s": mid["decode_rows"] / mid["decode_s"], "context": prompt_len + new_tokens // 2}


async def greedy(session, url: str, prompt: list[int], n: int = 16) -> list[int]:
    out = await http_client.generate(session, url, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}, timeout=120)
    return out["output_ids"]


async def memory_state(session, url: str) -> dict:
    info = await http_client.get(session, url, "/get_server_info", timeout=30)
    return info["internal_states"][0]["memory"]


async def memory_check(session, url: str, prompt: list[int]) -> dict:
    """Release everything (weights backed up in host memory), read the device's counters, resume, compare greedy
    tokens before and after."""
    before_tokens = await greedy(session, url, prompt)
    m0 = await memory_state(session, url)
    r = await http_client.post(session, url, "/release_memory_occupation", {}, timeout=120)
    if not r.get("success"):
        raise RuntimeError(f"/release_memory_occupation: {r}")
    m1 = await memory_state(session, url)
    r = await http_client.post(session, url, "/resume_memory_occupation", {}, timeout=120)
    if not r.get("success"):
        raise RuntimeError(f"/resume_memory_occupation: {r}")
    after_tokens = await greedy(session, url, prompt)
    out = {"weight_bytes": m0["weight_bytes"], "kv_cache_bytes": m0["kv_cache_bytes"],
           "released_weight_bytes_left": m1["weight_bytes"], "same_tokens_after_resume": before_tokens == after_tokens}
    if "device_free_bytes" in m0:
        held = m0["weight_bytes"] + m0["kv_cache_bytes"]
        out.update(device_reserved_before=m0["device_reserved_bytes"], device_reserved_released=m1["device_reserved_bytes"],
                   device_given_back=m1["device_free_bytes"] - m0["device_free_bytes"],
                   given_back_ok=m1["device_free_bytes"] - m0["device_free_bytes"] >= 0.9 * held)
    return out


async def run(opts, model_dir: str, vocab: int, max_pos: int, log_path: str) -> dict:
    prompt_len = max(8, min(opts.context, max_pos // 4))
    new_tokens = opts.new_tokens or max(16, min(1024, max_pos - prompt_len - 1))
    total = max(opts.rows) * (prompt_len + new_tokens) + 4096
    flags = ["--max-running-requests", str(max(opts.rows)), "--max-total-tokens", str(total), "--seed", "0",
             "--device", opts.device, "--cuda-graph-mode", opts.cuda_graph_mode]
    if opts.memory_check:
        flags += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    t0 = time.monotonic()
    server = EngineServer(model_dir, flags, log_path=log_path)
    try:
        server.wait_healthy(600)
        started = time.monotonic() - t0
        rng = random.Random(0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            info = await http_client.get(session, server.url, "/get_server_info", timeout=30)
            prompt = random_ids(rng, vocab, 12)
            served = await greedy(session, server.url, prompt)
            again = await greedy(session, server.url, prompt)
            together = [random_ids(rng, vocab, n) for n in (5, 17, 9, 30, 12)]  # 5 rows: padded to 8 by the graphs
            batch_tokens = await asyncio.gather(*(greedy(session, server.url, p) for p in together))
            print(f"engine on {info.get('device')} ({info.get('device_name')}), {info.get('dtype')}, CUDA graphs "
                  f"{info.get('cuda_graph_mode')}, started in "
                  f"{started:.1f}s; greedy tokens {served[:8]}... deterministic: {served == again}", flush=True)
            # warm-up: every row count once (each batch size has kernels, and cuBLAS heuristics, of its own)
            for r in opts.rows:
                await step_time(session, server.url, r, prompt_len, new_tokens, 0.05, rng, vocab, 1, strict=False)
            results = []
            for r in opts.rows:
                try:
                    res = await step_time(session, server.url, r, prompt_len, new_tokens, opts.seconds, rng, vocab,
                                          warmup=opts.warmup, windows=opts.windows)
                except RuntimeError as e:  # rows ran out of tokens inside the window (a slower box than planned for)
                    print(f"rows {r}: {e}; measured again over half the time", flush=True)
                    res = await step_time(session, server.url, r, prompt_len, new_tokens, opts.seconds / 2, rng, vocab,
                                          warmup=opts.warmup / 2, windows=opts.windows)
                results.append(res)
                print(f"rows {r:4d}: {res['step_ms']:7.2f} ms/step (issued after {res['launch_ms']:6.2f} ms, thread CPU "
                      f"{res['cpu_ms']:6.2f} ms), {res['tok_s']:9.0f} tok/s, x{res['step_ms'] / results[0]['step_ms']:.2f} "
                      f"of {results[0]['rows']} row(s)  [median of windows {res['window_ms']} ms; {res['steps']} steps, "
                      f"context ~{res['context']}]", flush=True)
            memory = await memory_check(session, server.url, prompt) if opts.memory_check else None
    finally:
        server.stop()
    ratio = results[-1]["step_ms"] / results[0]["step_ms"]
    out = {"model": opts.model, "device": info.get("device"), "device_name": info.get("device_name"),
           "dtype": info.get("dtype"), "startup_s": round(started, 1), "served": len(served) == 16,
           "deterministic": served == again, "prompt_len": prompt_len,
           "cuda_graph_mode": info.get("cuda_graph_mode"), "greedy_tokens": served, "greedy_batch_tokens": batch_tokens,
           "step_ms": {str(r["rows"]): round(r["step_ms"], 3) for r in results},
           "launch_ms": {str(r["rows"]): round(r["launch_ms"], 3) for r in results},
           "mean_step_ms": {str(r["rows"]): round(r["mean_step_ms"], 3) for r in results},
           "window_ms": {str(r["rows"]): r["window_ms"] for r in results},
           "tok_s": {str(r["rows"]): round(r["tok_s"], 1) for r in results},
           f"step_{results[-1]['rows']}_over_{results[0]['rows']}": round(ratio, 3), "flat_ok": ratio <= FLAT_LIMIT}
    if memory is not None:
        out["memory"] = memory
        print(f"memory: weights {memory['weight_bytes'] / 2**30:.2f} GiB + KV {memory['kv_cache_bytes'] / 2**30:.2f} GiB; "
              + (f"released: the device got {memory['device_given_back'] / 2**30:.2f} GiB back (reserved "
                 f"{memory['device_reserved_before'] / 2**30:.2f} -> {memory['device_reserved_released'] / 2**30:.2f} GiB); "
                 if "device_given_back" in memory else "")
              + f"greedy tokens unchanged after resume: {memory['same_tokens_after_resume']}", flush=True)
    print(f"step at {results[-1]['rows']} rows / at {results[0]['rows']}: {ratio:.2f}x "
          f"({'within' if ratio <= FLAT_LIMIT else 'NOT within'} {FLAT_LIMIT:.0f}x)", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.5b", choices=["qwen3-0.5b", "quickstart"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 128])
    p.add_argument("--context", type=int, default=512, help="prompt tokens per row (at most a quarter of the context)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens each row may generate (default: up to 1024)")
    p.add_argument("--seconds", type=float, default=2.0, help="measured time per row count")
    p.add_argument("--warmup", type=float, default=0.5,
                   help="seconds each row count decodes before it is measured (after a short first pass over them all)")
    p.add_argument("--windows", type=int, default=3, help="the measured time in this many windows: the median counts")
    p.add_argument("--device", default="auto", help="the engine's --device")
    p.add_argument("--cuda-graph-mode", default="auto", choices=["auto", "capture", "static", "off"],
                   help="the engine's --cuda-graph-mode (auto: CUDA graphs on a GPU, none on the CPU)")
    p.add_argument("--memory-check", action="store_true", help="release and resume the engine's memory at the end")
    p.add_argument("--model-cache", default=None, help="build the model here (reused when already built)")
    p.add_argument("--json-out", default=None)
    opts = p.parse_args(argv)
    tok = build_tokenizer(VOCAB)
    spec = model_preset(opts.model)
    with tempfile.TemporaryDirectory(prefix="engine_step_") as tmp:
        t0 = time.monotonic()
        model_dir = build_preset(opts.model, opts.model_cache or tmp, tok)
        print(f"model {opts.model}: hidden {spec.hidden_size} x {spec.num_hidden_layers} layers, vocab "
              f"{spec.vocab_size or len(tok)}, context {spec.max_position_embeddings} ({time.monotonic() - t0:.1f}s to "
              f"build or find)", flush=True)
        log_dir = os.path.dirname(os.path.abspath(opts.json_out)) if opts.json_out else opts.model_cache or tmp
        out = asyncio.run(run(opts, model_dir, len(tok), spec.max_position_embeddings,
                              os.path.join(log_dir, f"engine_step_{opts.model}.engine.log")))
    print(json.dumps(out))
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
