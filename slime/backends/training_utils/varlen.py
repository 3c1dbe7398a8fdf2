"""Causal attention over packed sequences (samples back to back in one row,
attention never crossing a sample boundary), for both trainer backends.

Kernels, in order of preference:
- `flash_attn_varlen_func` (the flash-attn package) when installed, on CUDA in fp16 / bf16;
- torch's own variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`) on CUDA
  in fp16 / bf16;
- otherwise one `scaled_dot_product_attention` call per sample (causal; on CPU, in fp32, with
  dropout): exact and O(sum of L^2), never a [T, T] mask.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _torch_varlen():
    """torch's varlen_attn and how its signature asks for causality and GQA (it changed across 2.10 / 2.11)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


@functools.lru_cache(maxsize=1)
def _flash_attn():
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (a broken build: fall back, say why once)
        logger.warning("flash_attn is installed but does not import (%s); packed attention uses torch's kernels", e)
        return None
    return flash_attn_varlen_func


def kernel_name(q: Tensor, dropout_p: float = 0.0) -> str:
    """Which kernel `packed_causal_attention` uses for `q` (logged at start-up, asserted by tests)."""
    fast = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if fast and _flash_attn() is not None:
        return "flash_attn_varlen"
    if fast and dropout_p == 0.0 and _torch_varlen() is not None:
        return "torch_varlen"
    return "per_sample_sdpa"


def packed_causal_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                            scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """q [T, Hq, D], k / v [T, Hkv, D] (Hq a multiple of Hkv), `cu_seqlens` [n + 1] int32 on q's device
    -> [T, Hq, D]; token t attends to the tokens of its own segment up to itself."""
    kernel = kernel_name(q, dropout_p)
    if kernel == "flash_attn_varlen":
        cu = cu_seqlens.to(torch.int32)
        return _flash_attn()(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout_p, softmax_scale=scale,
                             causal=True)
    if kernel == "torch_varlen":
        fn, causal, gqa, has_scale = _torch_varlen()
        kw = dict(causal)
        if k.size(1) != q.size(1):
            if gqa:
                kw["enable_gqa"] = True
            else:
                rep = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if scale is not None:
            if has_scale:
                kw["scale"] = scale
            else:
                q = q * (scale * q.size(-1) ** 0.5)
        cu = cu_seqlens.to(torch.int32)
        return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)
    bounds = cu_seqlens.tolist()
    gqa = k.size(1) != q.size(1)
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        # [L, H, D] -> [1, H, L, D]
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p, is_causal=b - a > 1, scale=scale,
                                           enable_gqa=gqa)
        outs.append(o.squeeze(0).transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()
