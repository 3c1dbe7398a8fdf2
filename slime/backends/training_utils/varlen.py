"""Causal attention over packed sequences (attention never crossing a sample boundary): flash-attn's varlen
kernel where installed, else torch's varlen kernel (CUDA, fp16 / bf16), else one SDPA call per sample (exact,
never a [T, T] mask)."""

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
    if fast and dropout_p == 0.0 and _torch_varlen() is not None and _torch_varlen_works(q.device, q.dtype):
        return "torch_varlen"
    return "per_sample_sdpa"


@functools.lru_cache(maxsize=None)
def _torch_varlen_works(dev: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: whether torch's (prototype) varlen kernel runs here and agrees with SDPA."""
    g = torch.Generator(device=dev).manual_seed(0)
    lengths = [7, 1, 12]
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32, device=dev)
    q = torch.randn(sum(lengths), 4, 64, device=dev, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(sum(lengths), 2, 64, device=dev, dtype=dtype, generator=g) for _ in range(2))
    try:
        with torch.enable_grad():  # first use may come inside a no-grad forward (old log-probs)
            out = _call_torch_varlen(q, k, v, cu, max(lengths), None)
            out.float().sum().backward()
        want = _per_sample(q.detach().float(), k.float(), v.float(), cu, None, 0.0)
        err = float((out.detach().float() - want).abs().max())
    except Exception as e:  # noqa: BLE001  (a kernel that does not run here: fall back, say why)
        logger.warning("torch varlen attention does not run on %s/%s (%s): packed attention uses one SDPA call per "
                       "sample", dev, dtype, (str(e).splitlines() or [type(e).__name__])[0][:200])
        return False
    if not err < 5e-2 or q.grad is None or not bool(torch.isfinite(q.grad).all()):
        logger.warning("torch varlen attention disagrees with SDPA on %s/%s (max |diff| %.3g): packed attention uses "
                       "one SDPA call per sample", dev, dtype, err)
        return False
    logger.info("packed attention on %s/%s: torch varlen kernel (max |diff| vs SDPA %.2g)", dev, dtype, err)
    return True


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
        return _call_torch_varlen(q, k, v, cu_seqlens, max_seqlen, scale)
    return _per_sample(q, k, v, cu_seqlens, scale, dropout_p)


def _call_torch_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                       scale: float | None) -> Tensor:
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
        else:  # the kernel's own scale is 1 / sqrt(D)
            q = q * (scale * q.size(-1) ** 0.5)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kw)


def _per_sample(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None, dropout_p: float) -> Tensor:
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
