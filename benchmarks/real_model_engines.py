"""Rollout tokens/s of the real model (SmolLM2-135M-Instruct, fp32) on SGLang's own server (0.5.23 on CPU) beside
the embedded engine, at the same number of requests in flight, side by side in one run.

    python benchmarks/real_model_engines.py [--in-flight 16] [--new-tokens 32] [--rounds 1] [--passes 2]

Each engine is started as a run starts it (EngineGroup: `--rollout-backend sglang` from tools/sglang_cpu_env.py's
venv, `--rollout-backend embedded` with `--embedded-engine-threads 1` (the default) and 2); the prompts are the
real-model task's chat prompts (reasoning-gym arithmetic). A closed loop per in-flight count: that many workers,
each sending `--rounds` requests of `--new-tokens` sampled tokens (ignore_eos) back to back; the engines take turns
pass by pass, so the box's drift hits them alike. Prints tokens/s per engine and its ratio to SGLang; the last line
is one JSON. Needs the converted model (tools/convert_smollm2.py, cached in runs/smollm2/model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

ENGINES = {"sglang": ("--rollout-backend", "sglang"),
           "embedded-1-thread": ("--rollout-backend", "embedded", "--embedded-engine-threads", "1"),
           "embedded-2-threads": ("--rollout-backend", "embedded", "--embedded-engine-threads", "2")}


def _start(name: str, model_dir: str, data: str, work: str):
    import sglang_cpu_env

    from slime.arguments import parse_args
    from slime.backends.sglang_utils.engine_group import EngineGroup

    extra = ["--sglang-python", sglang_cpu_env.install()] if name == "sglang" else []
    args = parse_args(["--hf-checkpoint", model_dir, "--prompt-data", data, "--input-key", "prompt", "--label-key",
                       "label", "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--run-dir", os.path.join(work, name), *ENGINES[name], *extra])
    return EngineGroup(args, log_dir=os.path.join(work, name, "logs")).start()


async def _tps(url: str, prompts: list[list[int]], in_flight: int, new_tokens: int, rounds: int) -> float:
    import aiohttp

    from slime.rollout.simulator.probes import closed_loop_tps

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await closed_loop_tps(session, url, prompts, in_flight, new_tokens, rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in-flight", type=int, nargs="+", default=[16])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="requests per worker per measurement")
    p.add_argument("--passes", type=int, default=2, help="measurements per engine and in-flight count (interleaved)")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    opts = p.parse_args()

    import convert_smollm2
    from transformers import AutoTokenizer

    model_dir = convert_smollm2.convert(os.path.join(REPO, "runs", "smollm2", "model"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = tempfile.mkdtemp(prefix="real_model_engines_")
    data = convert_smollm2.write_reasoning_gym(os.path.join(work, "data.jsonl"), num=64, seed=0)
    prompts = []
    for line in open(data):
        text = tok.apply_chat_template(json.loads(line)["prompt"], tokenize=False, add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    load = os.getloadavg()[0]
    groups = {name: _start(name, model_dir, data, work) for name in opts.engines}
    tps: dict[str, dict[int, list[float]]] = {name: {n: [] for n in opts.in_flight} for name in opts.engines}
    try:
        for _ in range(opts.passes):
            for n in opts.in_flight:
                for name, group in groups.items():
                    url = group.engine_urls[0]
                    tps[name][n].append(asyncio.run(_tps(url, prompts, n, opts.new_tokens, opts.rounds)))
                    print(f"  {name}, {n} in flight: {tps[name][n][-1]:.1f} tokens/s (load {os.getloadavg()[0]:.1f})",
                          flush=True)
    finally:
        for group in groups.values():
            group.shutdown()
    load = max(load, os.getloadavg()[0])
    result = {"model": "SmolLM2-135M-Instruct fp32", "new_tokens": opts.new_tokens, "rounds": opts.rounds,
              "passes": opts.passes, "load_avg_1m_max": round(load, 1), "cpus": os.cpu_count(), "tokens_per_s": {}}
    for n in opts.in_flight:
        ref = statistics.median(tps["sglang"][n]) if "sglang" in tps else None
        for name in opts.engines:
            med = statistics.median(tps[name][n])
            result["tokens_per_s"].setdefault(name, {})[n] = round(med, 1)
            ratio = f" = {med / ref:.2f}x SGLang" if ref else ""
            print(f"{n:3d} in flight  {name:20s} {med:7.1f} tokens/s{ratio}  (passes: "
                  f"{', '.join(f'{x:.1f}' for x in tps[name][n])})")
    print(f"(1-minute load average up to {load:.1f}, {os.cpu_count()} CPUs)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
