"""Throughput of the embedded engine vs a static-batch `model.generate` loop on the same tiny Qwen3.

    python benchmarks/engine_throughput.py [--new-tokens 64] [--prompt-len 16] [--levels 1,4,16,64]

Prints tokens/s at each number of requests in flight for both, the abort-all-to-idle
latency, and ends with one JSON line. Indicative only: the box is small and shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import tempfile
import time

import aiohttp
import torch

from slime.backends.hf_engine.local_server import EngineServer
from slime.rollout.simulator.probes import abort_to_idle_s, closed_loop_tps, requests_in_flight
from slime.rollout.simulator.gpu_presets import gpu_cost_model
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

logger = logging.getLogger("engine_throughput")


def static_generate_tps(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    """Tokens/s of `model.generate` on one static batch (all prompts the same length, sampling at T=1)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    model.generate(input_ids=ids[:, :4], attention_mask=mask[:, :4], max_new_tokens=2, do_sample=True)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
        assert out.shape[1] == ids.shape[1] + new_tokens
    return repeats * len(prompts) * new_tokens / (time.perf_counter() - t0)


async def engine_tps(url: str, prompts: list[list[int]], in_flight: int, new_tokens: int, rounds: int) -> float:
    """Closed loop: `in_flight` workers, each sending `rounds` requests back to back (the simulator's
    calibration measures the same curve: slime/rollout/simulator/calibrate.py)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await closed_loop_tps(session, url, prompts, in_flight, new_tokens, rounds)


async def abort_to_idle_ms(url: str, prompts: list[list[int]], n: int) -> float:
    """Put `n` long requests in flight, abort all, time until every response is back and the engine is idle."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        ms = 1000 * await abort_to_idle_s(session, url, prompts, n)
        busy = await requests_in_flight(session, url)
    assert busy == 0, f"{busy} requests still in flight after the abort"
    return ms


def gpu_scale(levels: list[int], prompt_len: int, new_tokens: int) -> str:
    """The simulator's engine model of Qwen3-4B on one H100 (datasheet numbers) at the same levels."""
    cost = gpu_cost_model("h100", "qwen3-4b", tp=1)
    ctx = prompt_len + new_tokens // 2
    return "  ".join(f"{c}: {cost.tokens_per_s(c, ctx):,.0f}" for c in levels) + f"  (x{cost.tokens_per_s(max(levels), ctx) / cost.tokens_per_s(min(levels), ctx):.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--vocab", type=int, default=2000, help="number of words in the tokenizer")
    ap.add_argument("--rounds", type=int, default=2, help="requests per in-flight slot")
    ap.add_argument("--reps", type=int, default=3, help="measurements per level (best is kept)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    levels = [int(x) for x in args.levels.split(",")]
    rng = random.Random(0)

    with tempfile.TemporaryDirectory() as tmp:
        tok = build_tokenizer([f"w{i}" for i in range(args.vocab)])
        spec = TinyQwen3Spec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, max_position_embeddings=1024)
        model = build_tiny_qwen3(tmp, tok, spec).eval()
        n_params = sum(p.numel() for p in model.parameters())
        prompts = [[tok.bos_token_id] + [rng.randrange(3, len(tok)) for _ in range(args.prompt_len - 1)] for _ in range(256)]
        logger.info("tiny Qwen3: %.2f M params, vocab %d", n_params / 1e6, len(tok))

        # The box is shared: measure static and engine back to back at each level, a few times, and keep
        # the best of each (contention only ever slows a run down).
        server = EngineServer(tmp, ["--num-threads", "1", "--max-running-requests", str(max(levels))]).wait_healthy(300)
        try:
            static = {c: 0.0 for c in levels}
            engine = {c: 0.0 for c in levels}
            for c in levels:
                for _ in range(args.reps):
                    static[c] = max(static[c], static_generate_tps(model, prompts[:c], args.new_tokens, repeats=1 if c >= 16 else 2))
                    engine[c] = max(engine[c], asyncio.run(engine_tps(server.url, prompts, c, args.new_tokens, args.rounds)))
                logger.info("%d in flight: engine %.0f tok/s, static generate %.0f tok/s", c, engine[c], static[c])
            abort_ms = min(asyncio.run(abort_to_idle_ms(server.url, prompts, max(levels))) for _ in range(2))
        finally:
            server.stop()

    top, one = max(levels), min(levels)
    print(f"{'in flight':>10} {'engine tok/s':>14} {'static tok/s':>14} {'ratio':>7}")
    for c in levels:
        print(f"{c:>10} {engine[c]:>14.0f} {static[c]:>14.0f} {engine[c] / static[c]:>7.2f}")
    print(f"abort-all to idle with {top} in flight: {abort_ms:.1f} ms (best of 2)")
    print(f"simulator, GPU scale (Qwen3-4B on 1 x H100, modelled from datasheets) tok/s at the same levels: "
          f"{gpu_scale(levels, args.prompt_len, args.new_tokens)}")
    result = {
        "params_m": round(n_params / 1e6, 3), "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
        "engine_tok_s": {str(c): round(engine[c], 1) for c in levels},
        "static_tok_s": {str(c): round(static[c], 1) for c in levels},
        f"engine_vs_static_at_{top}": round(engine[top] / static[top], 3),
        f"engine_{top}_vs_{one}": round(engine[top] / engine[one], 2),
        "abort_all_to_idle_ms": round(abort_ms, 1),
        "sim_gpu_h100_qwen3_4b_tok_s": {str(c): round(gpu_cost_model("h100", "qwen3-4b").tokens_per_s(
            c, args.prompt_len + args.new_tokens // 2)) for c in levels},
        "targets_met": {"vs_static>=1.3": engine[top] / static[top] >= 1.3, "scaling>=8": engine[top] / engine[one] >= 8,
                        "abort<=50ms": abort_ms <= 50},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
