"""Where the embedded engine's memory goes after a load burst and /flush_cache: ours or the allocator's?

Runs the embedded engine's HTTP server in this process (a thread), measures the
process RSS at idle, after a burst of concurrent long requests, and after
/flush_cache; then accounts for what is still allocated:
- ours: the paged KV pool (its blocks kept, by design, for the next rows;
  /release_memory_occupation frees it) and every other live torch tensor;
- the allocator: what `malloc_trim(0)` gives back to the OS (freed memory
  glibc kept in its arenas).

    python benchmarks/engine_memory.py [--model runs/tiny/model-sft] [--requests 128] [--tokens 192]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import socket
import sys
import threading
import time
import warnings

import psutil
import requests

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MB = 1024**2


def rss() -> float:
    return psutil.Process().memory_info().rss / MB


def tensor_bytes(objs) -> float:
    import torch

    seen, total = set(), 0
    for t in objs:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total / MB


def live_tensor_mb() -> float:
    import torch

    gc.collect()
    warnings.filterwarnings("ignore", category=FutureWarning)  # isinstance() on torch's deprecated module aliases
    return tensor_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))


def kv_pool_mb(sched) -> float:
    return sched.kv_cache_bytes() / MB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/tiny/model-sft")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--tokens", type=int, default=192)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from aiohttp import web

    from slime.backends.hf_engine.engine import Engine, EngineConfig
    from slime.backends.hf_engine.server import build_app

    engine = Engine(EngineConfig(model_path=a.model, seed=0))
    port = free_port()

    async def serve_here() -> None:  # server.serve() wants the main thread (signal handlers)
        engine.start()
        runner = web.AppRunner(build_app(engine, "127.0.0.1", port), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    threading.Thread(target=lambda: asyncio.run(serve_here()), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if requests.get(url + "/health", timeout=1).ok:
                break
        except requests.RequestException:
            time.sleep(0.1)

    def generate(n_tokens: int) -> None:
        requests.post(url + "/generate", json={"input_ids": [1, 5, 6, 12], "sampling_params": {
            "max_new_tokens": n_tokens, "ignore_eos": True, "temperature": 1.0}}, timeout=600).raise_for_status()

    generate(4)
    idle = rss()
    tensors_idle = live_tensor_mb()
    threads = [threading.Thread(target=generate, args=(a.tokens,)) for _ in range(a.requests)]
    for t in threads:
        t.start()
    peak = rss()
    for t in threads:
        t.join()
    after_burst = rss()
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()
    after_flush = rss()
    tensors_after = live_tensor_mb()
    kv_after = kv_pool_mb(engine.scheduler)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    after_trim = rss()
    out = {
        "idle_rss_mb": round(idle, 1),
        "burst_rss_mb": round(max(peak, after_burst), 1),
        "after_flush_rss_mb": round(after_flush, 1),
        "retained_after_flush_mb": round(after_flush - idle, 1),
        "ours_live_tensors_growth_mb": round(tensors_after - tensors_idle, 1),
        "ours_kv_pool_mb": round(kv_after, 1),
        "allocator_returned_by_malloc_trim_mb": round(after_flush - after_trim, 1),
        "after_malloc_trim_rss_mb": round(after_trim, 1),
    }
    print(json.dumps(out, indent=2))
    engine.scheduler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
