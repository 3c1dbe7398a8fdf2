"""Engine cost models for GPUs we cannot measure here, from datasheet numbers and a model's shape.

Decode is memory-bound (weights and KV read per step at an achieved share of bandwidth, plus a fixed per-step cost
and TP all-reduces); prefill compute-bound. Sources: NVIDIA H100 SXM5 (3.35 TB/s, 989 TFLOPS dense BF16) and H200
(4.8 TB/s) datasheets, AMD MI300X (5.3 TB/s, 1,307 TFLOPS), Qwen3-4B's `config.json`. Assumed (keyword
arguments): 70% of bandwidth, 45% of FLOPs, 2.5 ms per step, 10 us per all-reduce, SGLang's optimistic admission."""

from __future__ import annotations

from dataclasses import dataclass

from slime.rollout.simulator.cost_model import EngineCostModel


@dataclass(frozen=True)
class GPUSpec:
    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    memory_bytes: float
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    source: str
    bytes_per_param: int = 2  # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_param

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


GPUS = {
    "h100": GPUSpec("H100 SXM", 3.35e12, 989.4e12, 80e9, "NVIDIA H100 datasheet (SXM5: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense BF16)"),
    "h200": GPUSpec("H200", 4.8e12, 989.4e12, 141e9, "NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, 989 TFLOPS dense BF16)"),
    "mi300x": GPUSpec("MI300X", 5.3e12, 1307.4e12, 192e9, "AMD Instinct MI300X datasheet (192 GB HBM3, 5.3 TB/s, 1307 TFLOPS dense BF16)"),
}

MODELS = {
    "qwen3-4b": ModelSpec("Qwen3-4B", 4.02e9, 36, 32, 8, 128,
                          "Qwen/Qwen3-4B config.json (hidden 2560, 36 layers, 32 q / 8 kv heads x 128, intermediate 9728, "
                          "vocab 151936, tied embeddings)"),
    "smollm2-135m": ModelSpec("SmolLM2-135M", 134.5e6, 30, 9, 3, 64,
                              "HuggingFaceTB/SmolLM2-135M-Instruct config.json (hidden 576, 30 layers, 9 q / 3 kv heads "
                              "x 64, intermediate 1536, vocab 49152, tied embeddings)"),
}


def gpu_cost_model(gpu: str = "h100", model: str = "qwen3-4b", tp: int = 1, mem_fraction: float = 0.6,
                   bw_efficiency: float = 0.7, prefill_mfu: float = 0.45, step_fixed_s: float = 2.5e-3,
                   allreduce_s: float = 10e-6, abort_s: float = 0.05, request_latency_s: float = 0.005,
                   step_overhead_s: float = 0.05, weight_update_s: float = 2.0, max_running: int = 1024,
                   max_prefill_tokens: int = 16384) -> EngineCostModel:
    """One SGLang engine of `tp` GPUs serving `model`."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r} (known: {', '.join(GPUS)})")
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r} (known: {', '.join(MODELS)})")
    g, m = GPUS[gpu], MODELS[model]
    bw = tp * g.hbm_bytes_per_s * bw_efficiency
    flops = tp * g.bf16_flops * prefill_mfu
    kv_pool = mem_fraction * g.memory_bytes * tp - m.weight_bytes
    if kv_pool <= 0:
        raise ValueError(f"{m.name} does not fit in {tp} x {g.name} at mem_fraction {mem_fraction}")
    allreduces = 2 * m.layers * allreduce_s if tp > 1 else 0.0
    return EngineCostModel(
        decode_base_s=step_fixed_s + allreduces + m.weight_bytes / bw,
        decode_per_seq_s=2 * m.params / (tp * g.bf16_flops * 0.5),  # the matmuls' FLOPs per sequence
        decode_per_token_s=m.kv_bytes_per_token / bw,
        prefill_base_s=2e-3,
        prefill_per_token_s=2 * m.params / flops,
        prefill_per_token2_s=2 * m.layers * m.q_heads * m.head_dim / flops,
        abort_s=abort_s, request_latency_s=request_latency_s, step_overhead_s=step_overhead_s,
        weight_update_s=weight_update_s, admit_wait_s=0.0, max_running=max_running,
        kv_capacity_tokens=int(kv_pool / m.kv_bytes_per_token), kv_admission="optimistic",
        max_prefill_tokens=max_prefill_tokens, prefill_ragged=True, pad_slack_tokens=0,
        name=f"{m.name} on {tp} x {g.name} (SGLang, modelled)",
        source=(f"{g.source}; {m.source}; assumed: {bw_efficiency:.0%} of peak bandwidth in decode, {prefill_mfu:.0%} of "
                f"peak FLOPs in prefill, {1e3 * step_fixed_s:.1f} ms fixed per decode step, {1e6 * allreduce_s:.0f} us per "
                f"all-reduce, mem_fraction {mem_fraction}"))


def cost_model_from_spec(spec: str) -> EngineCostModel:
    """A cost model from `gpu:<gpu>:<model>:tp<N>` (modelled) or a JSON file (calibrated)."""
    if spec.startswith("gpu:"):
        parts = spec.split(":")
        if len(parts) != 4 or not parts[3].startswith("tp") or not parts[3][2:].isdigit():
            raise ValueError(f"cost model {spec!r}: expected gpu:<gpu>:<model>:tp<N>, e.g. gpu:h100:qwen3-4b:tp2")
        return gpu_cost_model(parts[1], parts[2], tp=int(parts[3][2:]))
    return EngineCostModel.load(spec)
