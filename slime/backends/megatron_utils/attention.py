"""Core attention for megatron's local layer spec, padded or packed (`thd`): `SDPAttention` (torch SDPA, causal,
no mask; packed input through `training_utils.varlen`) and `PackedLocalAttention` (megatron's unfused attention,
once per sample on packed input)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from slime.backends.training_utils.varlen import packed_causal_attention


def _check(attn_mask_type, attention_mask, attention_bias, default_type) -> None:
    if attention_bias is not None:
        raise NotImplementedError("slime's core attention: attention biases are not supported")
    mask_type = attn_mask_type or default_type
    if mask_type != AttnMaskType.causal or attention_mask is not None:
        raise NotImplementedError(f"slime's core attention: causal attention without a mask only (got {mask_type})")


def _thd(packed_seq_params) -> bool:
    if packed_seq_params is None:
        return False
    if packed_seq_params.qkv_format != "thd":
        raise NotImplementedError(f"packed sequences in the {packed_seq_params.qkv_format!r} layout (thd only)")
    return True


class SDPAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        _check(attn_mask_type, attention_mask, attention_bias, self.attn_mask_type)
        dropout = self.attention_dropout.p if self.training else 0.0
        if _thd(packed_seq_params):  # [t, h, d]
            out = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                          packed_seq_params.max_seqlen_q, scale=self.softmax_scale, dropout_p=dropout)
            return out.reshape(out.size(0), 1, self.hidden_size_per_partition)
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=q.size(2) > 1,
                                             scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        # [b, h, s, d] -> [s, b, h*d]
        out = out.permute(2, 0, 1, 3).contiguous()
        return out.view(out.size(0), out.size(1), self.hidden_size_per_partition)


class PackedLocalAttention(DotProductAttention):
    """megatron's unfused attention; a packed micro-batch runs it once per sample."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not _thd(packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        _check(attn_mask_type, attention_mask, attention_bias, self.attn_mask_type)
        host = packed_seq_params.cu_seqlens_q_padded  # the host's copy when the trainer set it (model.py)
        bounds = (host if host is not None else packed_seq_params.cu_seqlens_q).tolist()
        outs = [super(PackedLocalAttention, self).forward(query[a:b, None], key[a:b, None], value[a:b, None], None,
                                                          attn_mask_type=attn_mask_type)
                for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs)  # [t, 1, h*d]
