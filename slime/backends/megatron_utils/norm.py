"""RMSNorm for the local layer spec, as HF computes it (fp32 statistics, scale in the input dtype), with sequence
parallelism (megatron's torch fallback refuses it); `CompiledRMSNorm` (`--compile-ops`) through torch.compile."""

from __future__ import annotations

import functools

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@functools.lru_cache(maxsize=1)
def compiled_rms_norm():
    # torch.compile specialises on the normalised width and the grad mode: hidden size and head dim, with and
    # without grad, are ~4 graphs (dynamo's limit is 8 per function)
    return torch.compile(rms_norm, dynamic=True)


class RMSNorm(nn.Module):
    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # under sequence parallelism each TP rank sees part of the tokens: finalize_model_grads sums
        # the gradients of parameters marked so across the TP group
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class CompiledRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # always 2-D and contiguous: the q/k norms see strided [s, b, heads, dim] views, the others [s, b, hidden]
        x2 = x.reshape(-1, x.size(-1)).contiguous()
        return compiled_rms_norm()(x2, self.weight, self.eps).view(x.shape)
