"""Core attention over torch's scaled_dot_product_attention, as a drop-in
for megatron's local `DotProductAttention` (same constructor, same
[s, b, heads, dim] tensors): `--attention-backend flash/auto` without
TransformerEngine. SDPA picks FlashAttention / memory-efficient kernels on
GPU (no [b, h, s, s] score matrix) and a fused kernel on CPU.

Sequences are right-padded and causal, so pad positions never influence
real ones and no mask is needed.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention biases are not supported")
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type != AttnMaskType.causal or attention_mask is not None:
            raise NotImplementedError(f"SDPAttention: causal attention without a mask only (got {mask_type})")
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=q.size(2) > 1,
                                             scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1))
        # [b, h, s, d] -> [s, b, h*d]
        out = out.permute(2, 0, 1, 3).contiguous()
        return out.view(out.size(0), out.size(1), self.hidden_size_per_partition)
