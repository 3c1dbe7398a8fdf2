"""Advantage estimators (GRPO, GSPO, REINFORCE++, REINFORCE++-baseline) and masked batch whitening.

Pure functions over per-sample 1-D tensors, rewards group-contiguous. A group of one sample, or of equal rewards,
gets advantage exactly 0 (a float32 mean can differ from equal values in the last bit, which the std would blow up)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")

GRPO_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def group_relative_rewards(rewards: Tensor, group_size: int, normalize_std: bool = True) -> Tensor:
    """Reward minus its group's mean, optionally / (std + eps); single or equal-reward groups get exactly 0."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_samples], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of the group size "
            f"(--n-samples-per-prompt={group_size})"
        )
    if rewards.numel() == 0:
        return rewards.clone()
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std = centered.std(dim=1, keepdim=True)  # unbiased, of the centred rewards (as upstream: same float32 ops)
        centered = centered / (std + GRPO_STD_EPS)
    equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)  # incl. single-sample groups
    centered = torch.where(equal, torch.zeros((), dtype=centered.dtype), centered)
    return centered.reshape(-1)


def normalize_advantages(
    advantages: Sequence[Tensor],
    masks: Sequence[Tensor],
    *,
    all_reduce: bool = False,
) -> list[Tensor]:
    """Masked whitening over the batch's masked-in tokens (unbiased variance; masked-out positions 0; fewer than
    two tokens: mean only); `all_reduce` uses the global batch statistics."""
    _check_lengths(advantages, masks, "advantages")
    if not advantages:
        return []
    device = advantages[0].device
    m = [mk.to(device=device, dtype=torch.float32) for mk in masks]
    a = [torch.where(mk != 0, adv.float(), torch.zeros((), device=device)) for adv, mk in zip(advantages, m)]
    count = sum(mk.sum() for mk in m)
    total = sum((x * mk).sum() for x, mk in zip(a, m))
    stats = torch.stack([torch.as_tensor(count, dtype=torch.float64), torch.as_tensor(total, dtype=torch.float64)])
    if all_reduce:
        stats = _all_reduce_sum(stats)
    n = stats[0]
    if n <= 0:
        return [torch.zeros_like(x) for x in a]
    mean = stats[1] / n
    sq = torch.stack([sum(((x.double() - mean) ** 2 * mk.double()).sum() for x, mk in zip(a, m))])
    if all_reduce:
        sq = _all_reduce_sum(sq)
    var = sq[0] / (n - 1) if n > 1 else torch.zeros((), dtype=torch.float64)
    out = []
    for x, mk in zip(a, m):
        y = x.double() - mean
        if n > 1:
            y = y * torch.rsqrt(var + WHITEN_EPS)
        out.append(torch.where(mk != 0, y, torch.zeros((), dtype=y.dtype, device=device)).to(torch.float32))
    return out


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1}, computed backwards over a 1-D tensor."""
    if gamma == 1.0:  # the common case: a reverse cumulative sum, no python loop
        return token_rewards.flip(0).cumsum(0).flip(0)
    out = torch.empty_like(token_rewards)
    running = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
    for t in range(token_rewards.numel() - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def compute_advantages(
    estimator: str,
    rewards: Tensor,
    group_size: int,
    response_masks: Sequence[Tensor],
    *,
    normalize_std: bool = True,
    kl: Sequence[Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    all_reduce: bool = False,
) -> list[Tensor]:
    """Per-token advantages, one 1-D tensor per sample, zero where the mask is 0: group-relative (grpo, gspo), or
    the KL-penalised discounted return / baseline-subtracted reward, whitened (reinforce_plus_plus[_baseline])."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"--advantage-estimator={estimator!r} is not one of {list(ESTIMATORS)}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if rewards.numel() != len(response_masks):
        raise ValueError(f"got {rewards.numel()} rewards but {len(response_masks)} response masks")
    if kl is not None:
        _check_lengths(kl, response_masks, "kl")
    masks = [mk.to(torch.float32) for mk in response_masks]

    if estimator in ("grpo", "gspo"):
        scalar = group_relative_rewards(rewards, group_size, normalize_std)
        return [scalar[i].to(mk.device) * mk for i, mk in enumerate(masks)]

    if estimator == "reinforce_plus_plus_baseline":
        scalar = group_relative_rewards(rewards, group_size, normalize_std=False)
        per_token = []
        for i, mk in enumerate(masks):
            adv = scalar[i].to(mk.device) * torch.ones_like(mk)
            if kl is not None and kl_coef:
                adv = adv - kl_coef * kl[i].detach().float()
            per_token.append(adv * mk)
        return normalize_advantages(per_token, masks, all_reduce=all_reduce)

    # reinforce_plus_plus
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"--gamma must be in [0, 1], got {gamma}")
    returns = []
    for i, mk in enumerate(masks):
        token_rewards = torch.zeros_like(mk)
        if kl is not None and kl_coef:
            token_rewards = -kl_coef * kl[i].detach().float() * mk
        idx = torch.nonzero(mk, as_tuple=False)
        if idx.numel() > 0:
            last = int(idx[-1])
            token_rewards = token_rewards.clone()
            token_rewards[last] += rewards[i].to(mk.device)
        returns.append(discounted_returns(token_rewards, gamma) * mk)
    return normalize_advantages(returns, masks, all_reduce=all_reduce)


def _check_lengths(values: Sequence[Tensor], masks: Sequence[Tensor], name: str) -> None:
    if len(values) != len(masks):
        raise ValueError(f"{name}: got {len(values)} samples but {len(masks)} masks")
    for i, (v, mk) in enumerate(zip(values, masks)):
        if v.shape != mk.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(v.shape)} but its mask has {tuple(mk.shape)}")


def _all_reduce_sum(t: Tensor) -> Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("all_reduce=True needs an initialised torch.distributed process group")
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
