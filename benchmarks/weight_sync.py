"""Weight sync, trainer -> embedded engine, by the three --update-weight-mode paths side by side:
tensor (shared memory on CPU; CUDA IPC handles on a GPU), distributed (a gloo broadcast group) and disk
(a safetensors directory), for the quick start's model and a ~0.5B-parameter random Qwen3.

One FSDP trainer (world size 1, in this process) and one engine (a subprocess) per model; the modes take
turns round by round (one warm-up round first: the broadcast group's set-up and the first shared-memory
segments are not measured); every sync is checked (the engine reports the new weight_version). Prints the
median seconds per sync of each mode and their ratios to tensor; the last line is one JSON.

    python benchmarks/weight_sync.py [--rounds 5] [--models quickstart random-0.5B]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
MODES = ("tensor", "distributed", "disk")


def random_qwen3_0_5b(root: str) -> str:
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    path = os.path.join(root, "random-qwen3-0.5B")
    spec = TinyQwen3Spec(hidden_size=1024, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=8,
                         intermediate_size=3072, max_position_embeddings=512)
    build_tiny_qwen3(path, build_tokenizer([str(i) for i in range(10)] + list("+-=")), spec, seed=0)
    return path


def bench_model(name: str, model_dir: str, rounds: int, log_dir: str) -> dict:
    import requests
    import torch

    from slime.arguments import parse_args
    from slime.backends.fsdp_utils.actor import FSDPTrainer
    from slime.backends.fsdp_utils.update_weight import FSDPWeightUpdater
    from slime.backends.hf_engine.local_server import EngineServer

    prompts = os.path.join(log_dir, f"{name}-prompts.jsonl")
    with open(prompts, "w") as f:
        f.write('{"prompt": "1+1", "label": "2"}\n')
    args = parse_args(["--hf-checkpoint", model_dir, "--prompt-data", prompts, "--rm-type", "math",
                       "--rollout-batch-size", "1", "--num-rollout", "1", "--colocate",
                       "--run-dir", os.path.join(log_dir, name)])
    engine = EngineServer(model_dir, ["--seed", "0"], log_path=os.path.join(log_dir, f"{name}-engine.log"))
    trainer = FSDPTrainer(args)
    try:
        engine.wait_healthy(600)
        info = trainer.init()
        updaters = {m: FSDPWeightUpdater(args.replace(update_weight_mode=m), trainer.model, 0) for m in MODES}
        times: dict[str, list[float]] = {m: [] for m in MODES}
        version = 0
        for r in range(rounds + 1):
            order = MODES[r % 3:] + MODES[: r % 3]  # rotate: no mode always runs after the same one
            for mode in order:
                version += 1
                t0 = time.perf_counter()
                updaters[mode].update([engine.url], version)
                dt = time.perf_counter() - t0
                served = requests.get(engine.url + "/get_model_info", timeout=30).json()["weight_version"]
                assert served == str(version), (mode, served, version)
                if r > 0:
                    times[mode].append(dt)
        for u in updaters.values():
            u.close()
        nbytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        return {"model": name, "params": info["num_params"], "bytes": nbytes,
                **{f"{m}_s": statistics.median(times[m]) for m in MODES},
                **{f"{m}_s_all": times[m] for m in MODES}}
    finally:
        trainer.shutdown()
        engine.stop()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--models", nargs="+", default=["quickstart", "random-0.5B"], choices=["quickstart", "random-0.5B"])
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as root:
        for name in a.models:
            if name == "quickstart":
                model_dir = os.path.join(REPO, "runs", "tiny", "model-sft")
                if not os.path.isdir(model_dir):
                    raise SystemExit(f"{model_dir} is missing: run `python tools/prepare_tiny_task.py --out runs/tiny`")
            else:
                model_dir = random_qwen3_0_5b(root)
            results.append(bench_model(name, model_dir, a.rounds, root))
    load = os.getloadavg()
    print(f"\nweight sync, median seconds per sync over {a.rounds} rounds (box load {load[0]:.1f} on {os.cpu_count()} cores)")
    print(f"{'model':<14}{'params':>12}{'MB':>9}{'tensor':>10}{'distributed':>13}{'disk':>10}{'dist/tensor':>13}{'disk/tensor':>13}")
    for r in results:
        print(f"{r['model']:<14}{r['params']:>12,}{r['bytes'] / 2**20:>9.1f}{r['tensor_s']:>10.3f}{r['distributed_s']:>13.3f}"
              f"{r['disk_s']:>10.3f}{r['distributed_s'] / r['tensor_s']:>12.1f}x{r['disk_s'] / r['tensor_s']:>12.1f}x")
    fastest = all(r["tensor_s"] < min(r["distributed_s"], r["disk_s"]) for r in results)
    print(json.dumps({"results": results, "tensor_fastest": fastest, "loadavg": load}))
    return 0 if fastest else 1


if __name__ == "__main__":
    sys.exit(main())
