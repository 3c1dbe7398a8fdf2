"""slime/utils/gpu_plan.py: the settings line, the placement, the memory estimate against peaks measured on a GPU."""

from __future__ import annotations

import json

import pytest

from slime.arguments import parse_args
from slime.utils.gpu_plan import GB, PROCESS_OVERHEAD, effective_settings, estimate_memory, placement
from slime.utils.model_shape import num_params, shape_from_config
from test_megatron_args import QWEN3, qwen3_config

# benchmarks/train_throughput.py's qwen3-0.5b: hidden 1024, 16 layers, 16 / 8 heads of 128, MLP 3072, tied
HALF_B = qwen3_config(16, 1024, 3072, 16, 8, True)
GiB = 2**30


def args(tmp_path, config: dict, *flags: str):
    (tmp_path / "m").mkdir(exist_ok=True)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    return parse_args(["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "p.jsonl"),
                       "--rm-type", "math", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
                       "--num-rollout", "1", "--dry-run", "h200", *flags])


@pytest.mark.parametrize("compile_ops, measured_gib", [("on", 20.5), ("off", 29.2)])
def test_estimate_against_the_measured_trainer_peaks(tmp_path, compile_ops, measured_gib):
    """Megatron bf16, TP 1, distributed optimizer, bf16 gradient reduction, micro-batches of 16,384 tokens."""
    a = args(tmp_path, HALF_B, "--train-backend", "megatron", "--use-dynamic-batch-size", "--max-tokens-per-gpu",
             "16384", "--rollout-max-response-len", "2048", "--no-accumulate-allreduce-grads-in-fp32",
             "--compile-ops", compile_ops)
    m = estimate_memory(a, shape_from_config(HALF_B), 141e9)
    allocated = m.phases["training (trainer GPUs)"] - PROCESS_OVERHEAD
    assert 0.85 < allocated / (measured_gib * GiB) < 1.15, allocated / GiB


def test_states_follow_precision_and_sharding(tmp_path):
    shape = shape_from_config(qwen3_config(*QWEN3["qwen3-4B"]))
    base = ["--actor-num-gpus-per-node", "8", "--colocate", "--tensor-model-parallel-size", "2"]
    a = args(tmp_path, qwen3_config(*QWEN3["qwen3-4B"]), *base)
    p = num_params(shape, 151936) / 2  # per TP rank (151936 is a multiple of 128)
    m = estimate_memory(a, shape, 80e9)
    assert (m.weights, m.grads, m.optimizer) == pytest.approx((2 * p, 4 * p, 12 * p / 4))  # bf16, fp32 grads, 4 DP
    assert m.phases["rollout"] < m.engine + 2 * PROCESS_OVERHEAD  # offloaded: the trainer leaves the engine the GPU
    fp32 = estimate_memory(args(tmp_path, qwen3_config(*QWEN3["qwen3-4B"]), *base, "--no-bf16",
                                "--no-use-distributed-optimizer", "--no-offload"), shape, 80e9)
    assert (fp32.weights, fp32.grads, fp32.optimizer) == pytest.approx((4 * p, 4 * p, 8 * p))
    assert fp32.phases["rollout"] == pytest.approx(m.phases["rollout"] + fp32.weights + fp32.grads + fp32.optimizer)
    assert fp32.activations == pytest.approx(2 * m.activations)  # fp32 activations


def test_placement_and_effective_settings(tmp_path):
    a = args(tmp_path, HALF_B, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
             "--rollout-num-gpus-per-engine", "2", "--tensor-model-parallel-size", "2")
    lines = placement(a)
    assert lines[0] == "node 0 GPU 0: trainer rank 0 (TP 0, DP 0)"
    assert lines[5] == "node 1 GPU 1: trainer rank 5 (TP 1, DP 2)"
    assert lines[8:] == ["rollout GPU 0: engine 0 (TP 0 of 2)", "rollout GPU 1: engine 0 (TP 1 of 2)",
                         "rollout GPU 2: engine 1 (TP 0 of 2)", "rollout GPU 3: engine 1 (TP 1 of 2)"]
    assert effective_settings(a) == (
        "trainer megatron: bf16 weights and compute, fp32 main weights and Adam state, gradients reduced in fp32; "
        "optimizer state sharded over 4 data-parallel rank(s) (distributed optimizer); trainer on its own devices "
        "(not colocated)")
    fsdp = args(tmp_path, HALF_B, "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2", "--colocate")
    assert effective_settings(fsdp) == (
        "trainer fsdp: bf16 compute over fp32 sharded weights and Adam state; optimizer state sharded over 2 rank(s) "
        "(FSDP2); trainer offloaded to host memory while the engines generate")
    assert placement(fsdp) == ["node 0 GPU 0: trainer rank 0 (TP 0, DP 0) + engine 0",
                               "node 0 GPU 1: trainer rank 1 (TP 0, DP 1) + engine 1"]
