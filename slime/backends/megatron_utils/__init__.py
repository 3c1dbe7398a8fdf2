"""Megatron-core trainer (`--train-backend megatron`): the same interface
as the FSDP trainer, on GPU (NCCL, bf16) and on CPU (gloo, through a small
runtime shim applied only where CUDA is absent).

- `actor.MegatronTrainer`: one rank (a Ray actor via RayTrainGroup), on the
  shared trainer skeleton (`training_utils.trainer`).
- `config` / `model` / `layer_spec` / `attention` / `norm`: GPTModel from the HF
  config (Qwen3, Qwen2, Llama): Transformer Engine's layer spec where it
  imports on CUDA, else the local spec with packed-aware SDPA attention and
  HF-exact RMSNorm (optionally torch.compile'd); the forward through the
  vocab-parallel chunked log-prob head.
- `hf_weights`: HF ⇄ Megatron tensors (per-group QKV, gate/up, TP shards).
- `optimizer`: Megatron's Adam + LR schedule.
- `checkpoint`: dist-checkpoints inside our atomic iter_NNNNNNN/ layout.
- `update_weight`: TP-gathered, HF-named weights to the engines.
- `convert`: HF dir <-> torch_dist (tools/convert_*.py, tools/export_hf.py).
- `parallel` / `cpu_shim`: process groups, seeds, the CPU shim.
Data plans, advantages and the loss are shared with FSDP
(`slime.backends.training_utils`).
"""

from __future__ import annotations

import warnings

# megatron-core says so at import, once per module, in every process: we do not use apex / TE on purpose
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
