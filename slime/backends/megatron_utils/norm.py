"""RMSNorm for the local layer spec, as HF's Qwen3/Qwen2/Llama compute it
(fp32 statistics, scale applied in the input dtype), and with sequence
parallelism: megatron's own torch fallback refuses `--sequence-parallel`
(apex / TransformerEngine norms are the only ones it allows)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # under sequence parallelism each TP rank sees part of the tokens: finalize_model_grads sums
        # the gradients of parameters marked so across the TP group
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)
