"""The loss of one micro-batch and the rollout-level preparation (advantages,
TIS weights, behaviour-vs-old mismatch) that feeds it.

Normalisation: every micro-batch loss is divided by the *global* denominator
of its optimizer step (tokens for ``token_mean``, samples for
``sample_mean``), counted over all ranks, so that summing micro-batches and
averaging data-parallel gradients gives exactly the loss of the whole step in
one batch. Reported metrics use the same denominators and are summed over
micro-batches and ranks. ``pg_clipfrac`` is the share of tokens where the PPO
clip is active (upstream slime's definition); with ``--eps-clip-c`` the dual
clip's share is ``pg_dual_clipfrac`` (GSPO included). Conventions of the loss
(log-ratio clamp, empty samples, GSPO with TIS) are in docs/CONTRACTS.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from slime.backends.training_utils.data import TrainItem
from slime.utils.ppo_utils import (
    aggregate_loss,
    clipped_surrogate,
    compute_advantages,
    compute_approx_kl,
    compute_gspo_ratio,
    compute_tis_weights,
    dual_clip_flags,
    group_relative_rewards,
    loss_agg_mode,
    normalize_advantages,
    policy_ratio,
)

logger = logging.getLogger(__name__)


def needs_ref(args) -> bool:
    return bool(args.use_kl_loss) or float(args.kl_coef) > 0


@dataclass
class RolloutTensors:
    """Per-position (flattened rollout) tensors computed before the update."""

    old_log_probs: list[Tensor]
    ref_log_probs: list[Tensor] | None
    advantages: list[Tensor]
    tis_weights: list[Tensor] | None
    metrics: dict[str, float]


def compute_rollout_tensors(
    args,
    groups: list[list[TrainItem]],
    old_log_probs: list[Tensor],
    ref_log_probs: list[Tensor] | None,
) -> RolloutTensors:
    """Advantages, TIS weights and mismatch metrics for the whole rollout
    (identical on every rank: inputs are gathered)."""
    items = [it for g in groups for it in g]
    masks = [it.loss_mask for it in items]
    metrics: dict[str, float] = {}
    estimator = args.advantage_estimator
    kl_coef = float(args.kl_coef)
    kl_type = args.kl_loss_type
    kl = None
    if ref_log_probs is not None:
        kl = [compute_approx_kl(o, r, kl_type) for o, r in zip(old_log_probs, ref_log_probs)]
        metrics["ref_kl"] = _masked_token_mean(kl, masks)

    if args.loss_type == "sft_loss":
        advantages = [torch.zeros_like(m) for m in masks]
    else:
        advantages = _advantages(args, estimator, groups, masks, kl, kl_coef)
    if args.normalize_advantages and estimator in ("grpo", "gspo"):
        advantages = normalize_advantages(advantages, masks)

    # engine (behaviour) vs trainer (old policy) log-prob mismatch
    diffs = [(o - it.rollout_log_probs).abs() for o, it in zip(old_log_probs, items)]
    mk = torch.cat(masks) if masks else torch.zeros(0)
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    metrics["logprob_abs_diff_max"] = float(d[mk != 0].max()) if bool((mk != 0).any()) else 0.0
    metrics["logprob_abs_diff_mean"] = float(d[mk != 0].mean()) if bool((mk != 0).any()) else 0.0

    # importance weights old/behaviour: always reported (ESS is a per-step
    # health metric), applied to the loss only with --use-tis
    tis = None
    if items:
        w, tis_metrics = compute_tis_weights(
            torch.cat(old_log_probs), torch.cat([it.rollout_log_probs for it in items]), mk,
            clip_high=float(args.tis_clip), clip_low=float(args.tis_clip_low),
        )
        if args.use_tis:
            tis = list(torch.split(w, [m.numel() for m in masks]))
        metrics.update(tis_metrics)
    return RolloutTensors(old_log_probs, ref_log_probs, advantages, tis, metrics)


def _advantages(args, estimator, groups, masks, kl, kl_coef) -> list[Tensor]:
    rewards = torch.tensor([it.reward for g in groups for it in g], dtype=torch.float32)
    sizes = {len(g) for g in groups}
    common = dict(normalize_std=not args.disable_grpo_std_normalization,
                  kl=kl, kl_coef=kl_coef, gamma=float(args.gamma))
    if len(sizes) <= 1 or estimator == "reinforce_plus_plus":
        size = sizes.pop() if len(sizes) == 1 and estimator != "reinforce_plus_plus" else 1
        return compute_advantages(estimator, rewards, size, masks, **common)
    # groups of unequal size (a FAILED sample was dropped from some group)
    if estimator in ("grpo", "gspo"):
        out, start = [], 0
        for g in groups:
            sl = slice(start, start + len(g))
            out += compute_advantages(estimator, rewards[sl], len(g), masks[sl],
                                      normalize_std=common["normalize_std"])
            start += len(g)
        return out
    if estimator == "reinforce_plus_plus_baseline":
        per_token, start = [], 0
        for g in groups:
            centered = group_relative_rewards(rewards[start : start + len(g)], len(g), normalize_std=False)
            for j in range(len(g)):
                i = start + j
                adv = centered[j] * torch.ones_like(masks[i])
                if kl is not None and kl_coef:
                    adv = adv - kl_coef * kl[i]
                per_token.append(adv * masks[i])
            start += len(g)
        return normalize_advantages(per_token, masks)
    raise ValueError(f"--advantage-estimator={estimator!r} is not supported")


def _masked_token_mean(values: list[Tensor], masks: list[Tensor]) -> float:
    if not values:
        return 0.0
    v, m = torch.cat(values), torch.cat(masks)
    return float((v * m).sum() / m.sum().clamp(min=1))


def micro_batch_loss(
    args,
    log_probs: list[Tensor],
    entropies: list[Tensor] | None,
    positions: list[int],
    masks: list[Tensor],
    rt: RolloutTensors,
    num_tokens: float,
    num_samples: float,
) -> tuple[Tensor, dict[str, float]]:
    """Loss (already divided by the step's global denominator) and metric
    parts (same normalisation) for one micro-batch of real items."""
    mode = loss_agg_mode(args)
    agg = dict(num_tokens=num_tokens, num_samples=num_samples)
    dev = log_probs[0].device  # rollout tensors live on the CPU; the model may not
    masks = [m.to(dev) for m in masks]

    def reduce(x: list[Tensor]) -> Tensor:
        return aggregate_loss(x, masks, mode, **agg)

    metrics: dict[str, float] = {}
    if args.loss_type == "sft_loss":
        loss = -reduce(log_probs)
        metrics["sft_loss"] = float(loss.detach())
        return loss, metrics

    old = [rt.old_log_probs[p].to(dev) for p in positions]
    adv = [rt.advantages[p].to(dev) for p in positions]
    lengths = [m.numel() for m in masks]
    # GSPO: the sequence ratio on every token; otherwise the token ratio. The
    # same clipped surrogate (PPO clip, then the dual clip) applies to both.
    if args.advantage_estimator == "gspo":
        ratio = torch.cat(compute_gspo_ratio(log_probs, old, masks))
    else:
        ratio = policy_ratio(torch.cat(log_probs), torch.cat(old))
    adv_flat = torch.cat(adv)
    pg_flat, clip_flat = clipped_surrogate(ratio, adv_flat, args.eps_clip, args.eps_clip_high, args.eps_clip_c)
    pg, clip = list(torch.split(pg_flat, lengths)), list(torch.split(clip_flat, lengths))
    if rt.tis_weights is not None:  # per token, also under GSPO (see compute_gspo_ratio)
        pg = [x * rt.tis_weights[p].to(dev) for x, p in zip(pg, positions)]
    pg_loss = reduce(pg)
    loss = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["pg_clipfrac"] = float(reduce(clip).detach())
    if args.eps_clip_c is not None:
        dual = dual_clip_flags(ratio, adv_flat, args.eps_clip_c)
        metrics["pg_dual_clipfrac"] = float(reduce(list(torch.split(dual, lengths))).detach())
    metrics["ppo_kl"] = float(reduce([(o - lp).detach() for o, lp in zip(old, log_probs)]))

    if entropies is not None:
        ent = reduce(entropies)
        metrics["entropy"] = float(ent.detach())
        coef = float(args.entropy_coef)
        if coef:
            loss = loss - coef * ent
    if args.use_kl_loss:
        if rt.ref_log_probs is None:
            raise RuntimeError("--use-kl-loss needs reference log-probs, but no reference model was built")
        ref = [rt.ref_log_probs[p].to(dev) for p in positions]
        kl = [compute_approx_kl(lp, r, args.kl_loss_type) for lp, r in zip(log_probs, ref)]
        kl_loss = reduce(kl)
        metrics["kl_loss"] = float(kl_loss.detach())
        loss = loss + float(args.kl_loss_coef) * kl_loss
    return loss, metrics
