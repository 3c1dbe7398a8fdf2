"""Rotary position embedding for the local layer spec (`RoPESelfAttention`, after the q / k norms): frequencies built
once per layer from the host's boundaries and shared by q and k, compiled with `--compile-ops`; the arithmetic is
megatron's `_apply_rotary_pos_emb_bshd`.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor


def apply_rope(t: Tensor, freqs: Tensor) -> Tensor:
    """t [..., D] rotated by `freqs` [..., R] (float32 angles, R <= D, broadcast against t's leading dims)."""
    rot = freqs.size(-1)
    x, rest = t[..., :rot], t[..., rot:]
    cos, sin = freqs.cos().to(t.dtype), freqs.sin().to(t.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.size(-1) else out


@functools.lru_cache(maxsize=1)
def _compiled_rope():
    return torch.compile(apply_rope, dynamic=True)


def rope_kernel(fused: bool):
    """`apply_rope`, through torch.compile when `fused` (one kernel forward, one backward)."""
    return _compiled_rope() if fused else apply_rope


def token_freqs(emb: Tensor, seq_len: int, packed_seq_params) -> Tensor | None:
    """Per-token frequencies [seq_len, 1, 1, R] from megatron's table `emb`, restarting at every packed sample;
    None where the host has no copy of the boundaries."""
    if packed_seq_params is None:
        return emb[:seq_len]
    host = packed_seq_params.cu_seqlens_q_padded
    if host is None or host.device.type != "cpu":
        return None
    lengths = (host[1:] - host[:-1]).tolist()
    if sum(lengths) != seq_len:
        raise ValueError(f"packed RoPE: the boundaries cover {sum(lengths)} tokens, the micro-batch has {seq_len}")
    return torch.cat([emb[:n] for n in lengths]) if len(lengths) > 1 else emb[:seq_len]


class RoPESelfAttention(SelfAttention):
    """megatron's SelfAttention with RoPE by `apply_rope` after the q / k norms; inference, different q / k tables
    and packed boundaries only on the device fall back to megatron's RoPE."""

    def __init__(self, *args, fused_rope: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_rope = fused_rope
        self._rope: tuple[Tensor, object] | None = None  # (megatron's frequency table, packed_seq_params) in forward

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        emb = kwargs.get("rotary_pos_emb")
        if isinstance(emb, tuple):
            emb = emb[0] if emb[0] is emb[1] else None
        psp = kwargs.get("packed_seq_params")
        host = None if psp is None else psp.cu_seqlens_q_padded
        ours = (emb is not None and not args and kwargs.get("inference_context") is None
                and kwargs.get("inference_params") is None
                and (psp is None or (host is not None and host.device.type == "cpu")))
        if not ours:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._rope = (emb, psp)
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate=output_gate,
                                                  split_qkv=split_qkv)
        if self._rope is None or not split_qkv:
            return out
        emb, psp = self._rope
        query, key = out[0], out[1]  # [s, b, heads, head_dim] (packed: b = 1)
        freqs = token_freqs(emb, query.size(0), psp)
        rope = rope_kernel(self.fused_rope)
        return (rope(query, freqs), rope(key, freqs), *out[2:])
