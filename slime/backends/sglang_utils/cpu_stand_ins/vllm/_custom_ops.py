"""`vllm._custom_ops.rotary_embedding` in plain torch, for SGLang's server on a CPU box (see ../README.md). As
vLLM's kernel: `cos_sin_cache[pos]` holds rot_dim/2 cosines then sines; the first rot_dim channels of every head
rotate; neox style pairs channel i with i + rot_dim/2, GPT-J style 2i with 2i+1."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                     cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Rotate `query` and `key` ([tokens, heads * head_size] or [tokens, heads, head_size]) in place."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1).long()).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [tokens, 1, rot_dim / 2]: one angle per pair, every head
    for x in (query, key):
        if x is None:
            continue
        heads = x.view(cos.shape[0], -1, head_size)
        rot = heads[..., :rot_dim]
        rot.copy_(_rotate(rot.float(), cos.float(), sin.float(), is_neox).to(x.dtype))
