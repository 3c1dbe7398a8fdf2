"""The log-prob / entropy head: per-token log-prob of the target and entropy from hidden states, chunk by chunk,
never holding [tokens, vocabulary] logits (the backward recomputes each chunk, as Liger-Kernel's fused linear
cross-entropy does); vocabulary-parallel over `tp_group`. Equal to log_softmax over the full logits up to rounding.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)

# logits per chunk when --log-probs-chunk-size is 0 (auto): 64 MiB of float32 on CPU, 1 GiB on a GPU
AUTO_CHUNK_LOGITS = {"cpu": 1 << 24, "cuda": 1 << 28}


def chunk_tokens(chunk_size: int, vocab_local: int, device: torch.device) -> int:
    """Tokens per chunk for `--log-probs-chunk-size` (0: auto from the vocabulary, -1: no chunking)."""
    if chunk_size > 0:
        return chunk_size
    if chunk_size == -1:
        return 1 << 62
    if chunk_size != 0:
        raise ValueError(f"--log-probs-chunk-size must be > 0, 0 (auto) or -1 (whole micro-batch), got {chunk_size}")
    budget = AUTO_CHUNK_LOGITS["cuda" if device.type == "cuda" else "cpu"]
    return max(1, budget // max(1, vocab_local))


def _all_reduce(t: Tensor, op, group) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _HeadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, vocab_start: int,
                valid: int, chunk: int, group, with_entropy: bool, fused: bool):
        n = hidden.size(0)
        w = weight[:valid]
        lp = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        ent = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        local_t = targets - vocab_start
        mine = (local_t >= 0) & (local_t < valid)
        local_t = local_t.clamp(0, max(valid - 1, 0))
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            if fused and valid:  # two passes over the chunk's raw logits, no float32 [c, valid] copy
                raw = hidden[a:b] @ w.t()
                m, picked = fused_kernels().max_and_target(raw, local_t[a:b], mine[a:b], temperature)
                _all_reduce(m, dist.ReduceOp.MAX, group)
                sums = fused_kernels().exp_sums(raw, m, temperature, with_entropy)
                del raw
                sums = torch.cat([sums[:1], picked[None], sums[1:]])
                sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
            else:
                sums, m = _chunk_sums_eager(hidden[a:b], w, temperature, local_t[a:b], mine[a:b], valid,
                                            with_entropy, group)
            lse[a:b] = m + sums[0].log()
            lp[a:b] = sums[1] - lse[a:b]
            if with_entropy:  # H = lse - sum p s = log Z' - sum p (s - m), Z' = sum e^(s-m)
                ent[a:b] = sums[0].log() - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, local_t, mine, lse, ent if with_entropy else lse)
        ctx.cfg = (temperature, valid, chunk, with_entropy, fused)
        ctx.set_materialize_grads(False)
        return (lp, ent) if with_entropy else (lp,)

    @staticmethod
    def backward(ctx, g_lp: Tensor | None, g_ent: Tensor | None = None):
        hidden, weight, local_t, mine, lse, ent = ctx.saved_tensors
        temperature, valid, chunk, with_entropy, fused = ctx.cfg
        if not with_entropy:
            g_ent = None
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                  if ctx.needs_input_grad[1] else None)
        if (g_lp is None and g_ent is None) or valid == 0:
            return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), *([None] * 8)
        w = weight[:valid]
        n = hidden.size(0)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            if fused:  # one pass: raw logits in, d loss / d logits out in the weights' dtype
                gz = fused_kernels().logit_grad(hidden[a:b] @ w.t(), lse[a:b], ent[a:b] if g_ent is not None else None,
                                                g_lp[a:b] if g_lp is not None else None,
                                                g_ent[a:b] if g_ent is not None else None, local_t[a:b], mine[a:b],
                                                temperature)
                _accumulate(gz, hidden[a:b], w, grad_h, grad_w, a, b, valid)
                continue
            s = _logits(hidden[a:b], w, temperature).sub_(lse[a:b, None])  # log p
            p = s.exp()
            # d lp / d s_j = 1[j = target] - p_j ; d H / d s_j = -p_j (log p_j + H)
            if g_ent is not None:
                s.add_(ent[a:b, None]).mul_(p).mul_(-g_ent[a:b, None])
                grad_s = s
                if g_lp is not None:
                    grad_s.sub_(p.mul_(g_lp[a:b, None]))
            else:
                grad_s = p.mul_(-g_lp[a:b, None])
                del s
            del p
            if g_lp is not None:  # rows whose target is on another TP rank add 0
                grad_s.scatter_add_(1, local_t[a:b, None], (g_lp[a:b] * mine[a:b])[:, None])
            if temperature != 1.0:
                grad_s.div_(temperature)
            gz = grad_s.to(hidden.dtype)
            del grad_s
            _accumulate(gz, hidden[a:b], w, grad_h, grad_w, a, b, valid)
            del gz
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), *([None] * 8)


def _accumulate(gz: Tensor, h: Tensor, w: Tensor, grad_h: Tensor | None, grad_w: Tensor | None, a: int, b: int,
                valid: int) -> None:
    """A chunk's d loss / d logits `gz` [c, valid] into the gradients of the hidden states and the weight."""
    if grad_h is not None:
        grad_h[a:b] = gz @ w
    if grad_w is not None:
        grad_w[:valid] += (gz.t() @ h).float()


def _chunk_sums_eager(h: Tensor, w: Tensor, temperature: float, local_t: Tensor, mine: Tensor, valid: int,
                      with_entropy: bool, group) -> tuple[Tensor, Tensor]:
    """A chunk's ([sum e^(s-m), target logit, (sum e^(s-m) (s-m))] summed over TP, max m), in place where it can."""
    s = _logits(h, w, temperature)  # [c, valid] float32
    if valid:
        picked = s.gather(1, local_t[:, None]).squeeze(1).masked_fill_(~mine, 0.0)
        m = s.max(dim=1).values
    else:
        picked = s.new_zeros(h.size(0))
        m = s.new_full((h.size(0),), float("-inf"))
    _all_reduce(m, dist.ReduceOp.MAX, group)
    s.sub_(m[:, None])  # shifted logits
    e = s.exp()
    sums = [e.sum(1), picked]
    if with_entropy:
        sums.append(e.mul_(s).sum(1))  # sum e^(s-m) (s-m)
    del e, s
    return _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group), m


# ------------------------------------------------------- fused kernels ----
def _max_and_target(raw: Tensor, local_t: Tensor, mine: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    s = raw.float()
    if temperature != 1.0:
        s = s / temperature
    picked = s.gather(1, local_t[:, None]).squeeze(1).masked_fill(~mine, 0.0)
    return s.amax(1), picked


def _exp_sums(raw: Tensor, m: Tensor, temperature: float, with_entropy: bool) -> Tensor:
    """[sum e^(s-m)] or [sum e^(s-m), sum e^(s-m) (s-m)] per row, [1 or 2, c]."""
    s = raw.float()
    if temperature != 1.0:
        s = s / temperature
    s = s - m[:, None]
    e = s.exp()
    return torch.stack([e.sum(1), (e * s).sum(1)]) if with_entropy else e.sum(1)[None]


def _logit_grad(raw: Tensor, lse: Tensor, ent: Tensor | None, g_lp: Tensor | None, g_ent: Tensor | None,
                local_t: Tensor, mine: Tensor, temperature: float) -> Tensor:
    """d loss / d raw logits, in `raw`'s dtype: the eager backward's arithmetic in one pass."""
    logp = raw.float()
    if temperature != 1.0:
        logp = logp / temperature
    logp = logp - lse[:, None]
    p = logp.exp()
    # d lp / d s_j = 1[j = target] - p_j ; d H / d s_j = -p_j (log p_j + H)
    if g_ent is not None:
        grad = (logp + ent[:, None]) * p * (-g_ent[:, None])
        if g_lp is not None:
            grad = grad - p * g_lp[:, None]
    else:
        grad = p * (-g_lp[:, None])
    if g_lp is not None:  # rows whose target is on another TP rank add 0
        hit = torch.arange(grad.size(1), device=grad.device)[None, :] == local_t[:, None]
        grad = grad + torch.where(hit, (g_lp * mine)[:, None], 0.0)
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(raw.dtype)


class FusedKernels:
    """The head's element-wise work per chunk through torch.compile (`--compile-ops`): no float32 [c, V] tensors;
    dynamic shapes, one graph for every chunk length."""

    def __init__(self):
        self.max_and_target = torch.compile(_max_and_target, dynamic=True)
        self.exp_sums = torch.compile(_exp_sums, dynamic=True)
        self.logit_grad = torch.compile(_logit_grad, dynamic=True)


@functools.lru_cache(maxsize=1)
def fused_kernels() -> FusedKernels:
    return FusedKernels()


def _logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    s = (h @ w.t()).float()
    if temperature != 1.0:
        s.div_(temperature)
    return s


def head_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, *,
                   vocab_size: int | None = None, vocab_start: int = 0, chunk_size: int = 0,
                   tp_group=None, with_entropy: bool = False, entropy_grad: bool = False, fused: bool = False
                   ) -> tuple[Tensor, Tensor | None]:
    """Per-token log_softmax(hidden @ weight.T / T)[target] and (optionally) entropy, float32 [N]. `weight`: this
    rank's vocabulary rows from `vocab_start`; rows at or past `vocab_size` are padding; `entropy_grad`: whether
    the entropy carries a gradient or is a metric only."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"head_log_probs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not line up")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"head_log_probs: {targets.numel()} targets for {hidden.size(0)} hidden states")
    if temperature <= 0:
        raise ValueError(f"head_log_probs: temperature must be > 0, got {temperature}")
    v_local = weight.size(0)
    real = v_local + vocab_start if vocab_size is None else vocab_size
    valid = max(0, min(v_local, real - vocab_start))
    chunk = chunk_tokens(chunk_size, v_local, hidden.device)
    if weight.dtype != hidden.dtype:
        hidden = hidden.to(weight.dtype)
    out = _HeadFunction.apply(hidden, weight, targets.to(hidden.device).long(), float(temperature), int(vocab_start),
                              valid, chunk, tp_group, bool(with_entropy), bool(fused))
    lp, ent = out[0], (out[1] if with_entropy else None)
    if ent is not None and not (entropy_grad and torch.is_grad_enabled()):
        ent = ent.detach()
    return lp, ent
