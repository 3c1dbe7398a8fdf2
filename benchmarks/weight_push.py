"""The colocated weight push at a model's size: a Megatron trainer (world size 1, in this process) hands its weights
to an embedded engine on the same device by `--update-weight-mode tensor` (CUDA IPC handles on a GPU, shared memory
on CPU), as `train.py --colocate` does after every step.

    python benchmarks/weight_push.py --model qwen3-4b-shape [--rounds 3] [--json OUT]   # ~8 GB of bf16 weights

One warm-up push (the engine's session and the first buckets), then `--rounds` timed ones; each is checked (the
engine serves the new weight_version). Prints seconds per push (median), the bytes, GB/s and the buckets; the goal
(issue 42) is Qwen3-4B's size in <= 0.2 s. The model is train_throughput.py's preset (random weights, bf16 on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_throughput import MODELS, build_model_dir  # noqa: E402

GOAL_S = 0.2


def run(o) -> dict:
    import requests
    import torch

    from slime.arguments import parse_args
    from slime.backends.hf_engine.local_server import EngineServer
    from slime.backends.megatron_utils.actor import MegatronTrainer

    cuda = torch.cuda.is_available()
    model_dir = build_model_dir(o.model, o.root, o.layers)
    args = parse_args(["--hf-checkpoint", model_dir, "--prompt-data", os.path.join(model_dir, "prompts.jsonl"),
                       "--rm-type", "math", "--rollout-batch-size", "1", "--num-rollout", "1", "--train-backend",
                       "megatron", "--colocate", "--no-offload", "--update-weight-mode", "tensor",
                       "--bf16" if cuda else "--no-bf16", "--run-dir", os.path.join(o.root, "weight_push_run"),
                       *o.extra])
    # the engine: no KV to speak of, no graphs (nothing decodes here)
    engine = EngineServer(model_dir, ["--seed", "0", "--max-total-tokens", "4096", "--max-running-requests", "4",
                                      "--cuda-graph-mode", "off"], log_path=os.path.join(o.root, "weight_push_engine.log"))
    trainer = MegatronTrainer(args)
    try:
        t0 = time.perf_counter()
        info = trainer.init()  # while the engine loads the same weights
        engine.wait_healthy(900)
        setup_s = time.perf_counter() - t0
        times, metrics = [], []
        for version in range(1, o.rounds + 2):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = trainer.update_weights([engine.url], version)
            dt = time.perf_counter() - t0
            served = requests.get(engine.url + "/get_model_info", timeout=30).json()["weight_version"]
            if served != str(version):
                raise RuntimeError(f"push {version}: the engine serves weight_version {served!r}")
            if version > 1:
                times.append(dt)
                metrics.append(m)
        nbytes = sum(p.numel() * p.element_size() for p in trainer.actor.core.parameters())
    finally:
        trainer.shutdown()
        engine.stop()
    dt = statistics.median(times)
    return {"model": o.model, "layers": o.layers or MODELS[o.model][1], "params": info.get("num_params"),
            "bytes": nbytes, "device": torch.cuda.get_device_name() if cuda else "cpu", "setup_s": setup_s,
            "push_s": dt, "push_s_all": times, "gb_per_s": nbytes / dt / 1e9, "updater_metrics": metrics[-1],
            "goal_s": GOAL_S, "goal_met": dt <= GOAL_S * nbytes / 8e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b-shape")
    p.add_argument("--layers", type=int, default=None, help="instead of the preset's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "slime_train_throughput"))
    p.add_argument("--json", default=None)
    o, extra = p.parse_known_args(argv)
    o.extra = [x for x in extra if x != "--"]
    os.makedirs(o.root, exist_ok=True)
    r = run(o)
    print(f"weight push, {r['model']} ({r['layers']} layers, {r['bytes'] / 1e9:.2f} GB) on {r['device']}, colocated "
          f"tensor mode: {r['push_s']:.3f} s median of {len(r['push_s_all'])} ({r['gb_per_s']:.1f} GB/s; set-up "
          f"{r['setup_s']:.0f} s); goal {GOAL_S} s for 8 GB, scaled to these bytes: "
          f"{'met' if r['goal_met'] else 'NOT met'}")
    print(json.dumps(r))
    if o.json:
        with open(o.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
