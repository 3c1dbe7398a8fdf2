"""RL math as pure functions over tensors: log-probs and entropy, KL estimators, PPO / GSPO losses, masked
aggregation, SFT loss and truncated importance sampling. Reductions over a sequence take the LAST dimension as
tokens, or a list of 1-D per-sample tensors."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from slime.utils.advantages import (  # noqa: F401  (re-exported)
    ESTIMATORS,
    compute_advantages,
    group_relative_rewards,
    normalize_advantages,
)

logger = logging.getLogger(__name__)

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token_mean", "sample_mean")
# |log-ratio| cap before exp() (avoids inf * 0 = NaN); see `clamp_log_ratio` for its gradient
MAX_LOG_RATIO = 20.0

TensorOrList = Tensor | Sequence[Tensor]


# ---------------------------------------------------------------- logits ----
def _effective_temperature(temperature: float) -> float:
    """Temperature 0 (greedy): log-probs and entropy of the unscaled distribution, as SGLang reports them."""
    if temperature < 0:
        raise ValueError(f"temperature (--rollout-temperature) must be >= 0, got {temperature}")
    return 1.0 if temperature == 0 else float(temperature)


def compute_log_probs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) gathered at ``tokens``, in float32 (temperature 0: unscaled)."""
    temperature = _effective_temperature(temperature)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} do not line up")
    scaled = logits.float() / temperature
    picked = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def compute_entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Per-position entropy of softmax(logits / temperature), in float32; stable for large and −inf logits."""
    temperature = _effective_temperature(temperature)
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    p = logp.exp()
    # p == 0 where logp == -inf; zero the log there so 0 * -inf never appears
    safe_logp = logp.masked_fill(torch.isneginf(logp), 0.0)
    return -(p * safe_logp).sum(dim=-1)


# -------------------------------------------------------------------- KL ----
def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kl_type: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (http://joschu.net/blog/kl-approx.html)."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        neg = -log_ratio  # log(ref / pi)
        kl = torch.exp(neg) - neg - 1.0
        return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl
    raise ValueError(f"--kl-loss-type={kl_type!r} is not one of {list(KL_TYPES)}")


# --------------------------------------------------------- policy losses ----
def clamp_log_ratio(log_ratio: Tensor) -> Tensor:
    """``log_ratio`` with its value clamped to ±MAX_LOG_RATIO and the identity's gradient (straight-through), so a
    token beyond the bound keeps a gradient instead of silently getting none."""
    clamped = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if not log_ratio.requires_grad:
        return clamped
    straight_through = log_ratio + (clamped - log_ratio).detach()
    # an infinite log-ratio (a -inf log-prob) has no usable gradient: plain clamp there, never inf - inf = NaN
    return torch.where(torch.isfinite(log_ratio), straight_through, clamped)


def policy_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """Per-token importance ratio exp(logp − sg(old_logp)), log-ratio clamped straight-through."""
    return torch.exp(clamp_log_ratio(log_probs.float() - old_log_probs.detach().float()))


def _check_clip(eps_clip: float, eps_clip_high: float | None, eps_clip_c: float | None) -> float:
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if not 0.0 <= eps_clip < 1.0:
        raise ValueError(f"--eps-clip must be in [0, 1), got {eps_clip}")
    if high < 0.0:
        raise ValueError(f"--eps-clip-high must be >= 0, got {high}")
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"--eps-clip-c (dual clip) must be > 1, got {eps_clip_c}")
    return high


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate (with optional dual clip): per-token loss and the clip flag (1 where the PPO bound is
    active, as upstream; dual-clipped tokens are counted apart)."""
    high = _check_clip(eps_clip, eps_clip_high, eps_clip_c)
    advantages = advantages.to(ratio.dtype)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if eps_clip_c is not None:
        cap = -advantages * eps_clip_c
        loss = torch.where((advantages < 0) & (loss > cap), cap, loss)
    return loss, clipped.to(ratio.dtype)


def dual_clip_flags(ratio: Tensor, advantages: Tensor, eps_clip_c: float) -> Tensor:
    """1.0 where the dual clip caps the loss (A < 0 and r > eps_clip_c), else 0.0 (``pg_dual_clipfrac``)."""
    return ((advantages < 0) & (ratio.detach() > eps_clip_c)).to(ratio.dtype)


def compute_gspo_ratio(log_probs: TensorOrList, old_log_probs: TensorOrList, mask: TensorOrList) -> TensorOrList:
    """GSPO per-token ratio: the value is the sequence's geometric mean ratio s; d ratio_t / d logp_t = s.

    With TIS each token's gradient is weighted by its own w_t (upstream spreads mean(w) over the sequence): with
    partial rollouts a response's tokens come from different policies, and TIS corrects each for its own."""
    if isinstance(log_probs, Tensor):
        return _gspo_ratio(log_probs, old_log_probs, mask)
    return [_gspo_ratio(lp, olp, mk) for lp, olp, mk in zip(log_probs, old_log_probs, mask, strict=True)]


def _gspo_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    lp = log_probs.float()
    diff = lp.detach() - old_log_probs.detach().float()
    seq_log_ratio = masked_mean(diff, mask, dim=-1).unsqueeze(-1)
    seq_log_ratio = seq_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(lp - lp.detach() + seq_log_ratio)


# ----------------------------------------------------------- aggregation ----
def loss_agg_mode(args) -> str:
    """``--calculate-per-token-loss`` → ``token_mean``, else ``sample_mean``."""
    return "token_mean" if args.calculate_per_token_loss else "sample_mean"


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask; masked positions contribute exactly 0 even when their value is NaN/inf."""
    mask = mask.to(device=values.device)
    weighted = torch.where(mask != 0, values * mask.to(values.dtype), torch.zeros((), dtype=values.dtype, device=values.device))
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ values·mask / Σ mask; 0 (not NaN) where the mask is empty, and still part of the autograd graph."""
    mask = mask.to(device=values.device)
    denom = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / denom.clamp(min=1.0)


def aggregate_loss(
    per_token_loss: TensorOrList,
    masks: TensorOrList,
    mode: str = "token_mean",
    *,
    num_tokens: float | None = None,
    num_samples: float | None = None,
) -> Tensor:
    """Reduce a per-token loss to a scalar: ``token_mean`` over real tokens (upstream counts one phantom token per
    empty sample) or ``sample_mean``; ``num_tokens`` / ``num_samples`` override the denominator."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"--loss-agg-mode={mode!r} is not one of {list(LOSS_AGG_MODES)}")
    if isinstance(per_token_loss, Tensor):
        losses, mks = [per_token_loss], [masks]
        n_seq = 1 if per_token_loss.dim() <= 1 else math.prod(per_token_loss.shape[:-1])
        if mode == "sample_mean" and per_token_loss.dim() > 1:
            per_sample = masked_mean(per_token_loss, masks, dim=-1)
            denom = float(num_samples) if num_samples is not None else max(n_seq, 1)
            return per_sample.sum() / max(denom, 1e-12)
    else:
        losses, mks = list(per_token_loss), list(masks)
        if len(losses) != len(mks):
            raise ValueError(f"aggregate_loss: {len(losses)} losses but {len(mks)} masks")
        n_seq = len(losses)
        if not losses:
            return torch.zeros((), requires_grad=False)
    if mode == "token_mean":
        total = sum(masked_sum(x, m) for x, m in zip(losses, mks))
        if num_tokens is not None:
            count = float(num_tokens)
        else:
            count = float(sum(m.float().sum().item() for m in mks))
        return total / max(count, 1.0)
    per_sample = torch.stack([masked_mean(x, m) for x, m in zip(losses, mks)])
    denom = float(num_samples) if num_samples is not None else max(n_seq, 1)
    return per_sample.sum() / max(denom, 1e-12)


def sft_loss(log_probs: TensorOrList, mask: TensorOrList) -> Tensor:
    """Negative masked mean log-likelihood over all masked tokens."""
    return -aggregate_loss(log_probs, mask, "token_mean")


# ---------------------------------------------- off-policy correction -------
def compute_ess(weights: Tensor, mask: Tensor) -> float:
    """Normalised effective sample size (Σw)² / (n Σw²) over masked tokens, in (0, 1]; empty mask: 1.0."""
    w = weights.detach().double()
    mk = mask.to(device=w.device) != 0
    n = int(mk.sum())
    if n == 0:
        return 1.0
    wm = w[mk]
    sq = float((wm * wm).sum())
    if sq <= 0.0:
        return 0.0
    return float(wm.sum()) ** 2 / (n * sq)


def truncated_is_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, clip_high: float = 2.0,
                         clip_low: float = 0.0) -> tuple[Tensor, Tensor]:
    """(clamp(exp(old − rollout), clip_low, clip_high), the raw exp(old − rollout)), detached, per token: what
    `compute_tis_weights` multiplies into the loss, without its metrics (nothing read back from the device)."""
    if clip_low < 0 or clip_high <= 0 or clip_low > clip_high:
        raise ValueError(
            f"need 0 <= --tis-clip-low ({clip_low}) <= --tis-clip ({clip_high}) and --tis-clip > 0"
        )
    log_w = (old_log_probs.detach().float() - rollout_log_probs.detach().float()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    raw = torch.exp(log_w)
    return raw.clamp(clip_low, clip_high), raw


def compute_tis_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    clip_high: float = 2.0,
    clip_low: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights clamp(exp(old − rollout), clip_low, clip_high), detached, and their metrics."""
    weights, raw = truncated_is_weights(old_log_probs, rollout_log_probs, clip_high, clip_low)
    mk = mask.to(device=raw.device)
    out_of_range = ((raw < clip_low) | (raw > clip_high)).float()
    metrics = {
        "tis_clipfrac": float(masked_mean(out_of_range, mk)),
        "tis_ess": compute_ess(weights, mk),
        "tis_weight_mean": float(masked_mean(weights, mk)),
        "tis_raw_weight_mean": float(masked_mean(raw, mk)),
    }
    return weights.detach(), metrics
