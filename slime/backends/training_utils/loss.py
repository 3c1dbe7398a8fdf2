"""The loss of one micro-batch and the rollout-level preparation (advantages, TIS weights, behaviour-vs-old
mismatch) that feeds it. Each micro-batch loss is divided by its optimizer step's *global* denominator (tokens or
samples, over all ranks), so summing micro-batches and averaging DP gradients gives the whole step's loss.
Conventions (old log-probs from the update's own forward, clamps, GSPO with TIS) are in docs/architecture.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from slime.backends.training_utils.data import TrainItem, to_device
from slime.utils.ppo_utils import (
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
    truncated_is_weights,
)

logger = logging.getLogger(__name__)


def needs_ref(args) -> bool:
    return bool(args.use_kl_loss) or float(args.kl_coef) > 0


def old_log_probs_needed(args, num_steps: int) -> bool:
    """Whether the old log-probs need a forward of their own (more than one optimizer step, or --kl-coef);
    otherwise they are the update's own forward, detached."""
    return num_steps > 1 or float(args.kl_coef) > 0


@dataclass
class RolloutTensors:
    """Per-position (flattened rollout) tensors computed before the update."""

    old_log_probs: list[Tensor] | None  # None: the update's own forward gives them (old_log_probs_needed)
    ref_log_probs: list[Tensor] | None
    advantages: list[Tensor]
    tis_weights: list[Tensor] | None  # --use-tis with old log-probs at hand (else computed per micro-batch)
    metrics: dict[str, float]


def compute_rollout_tensors(
    args,
    groups: list[list[TrainItem]],
    old_log_probs: list[Tensor] | None,
    ref_log_probs: list[Tensor] | None,
) -> RolloutTensors:
    """Advantages, TIS weights and mismatch metrics for the whole rollout (the same on every rank); without
    `old_log_probs` the TIS weights and their metrics come later (`behaviour_metrics`)."""
    items = [it for g in groups for it in g]
    masks = [it.loss_mask for it in items]
    metrics: dict[str, float] = {}
    estimator = args.advantage_estimator
    kl_coef = float(args.kl_coef)
    kl = None
    if ref_log_probs is not None and old_log_probs is not None:
        kl = [compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old_log_probs, ref_log_probs)]
    elif ref_log_probs is not None and kl_coef > 0:
        raise ValueError("--kl-coef folds a KL penalty into the advantages: it needs old and reference log-probs")

    if args.loss_type == "sft_loss":
        advantages = [torch.zeros_like(m) for m in masks]
    else:
        advantages = _advantages(args, estimator, groups, masks, kl, kl_coef)
    if args.normalize_advantages and estimator in ("grpo", "gspo"):
        advantages = normalize_advantages(advantages, masks)

    tis = None
    if old_log_probs is not None:
        more, tis = behaviour_metrics(args, items, old_log_probs, ref_log_probs)
        metrics.update(more)
    return RolloutTensors(old_log_probs, ref_log_probs, advantages, tis, metrics)


def behaviour_metrics(args, items: list[TrainItem], old_log_probs: list[Tensor], ref_log_probs: list[Tensor] | None
                      ) -> tuple[dict[str, float], list[Tensor] | None]:
    """The rollout's reference KL, engine-vs-trainer mismatch and TIS metrics, and the TIS weights (--use-tis)."""
    masks = [it.loss_mask for it in items]
    metrics: dict[str, float] = {}
    if ref_log_probs is not None:
        kl = [compute_approx_kl(o, r, args.kl_loss_type) for o, r in zip(old_log_probs, ref_log_probs)]
        metrics["ref_kl"] = _masked_token_mean(kl, masks)
    diffs = [(o - it.rollout_log_probs).abs() for o, it in zip(old_log_probs, items)]
    mk = torch.cat(masks) if masks else torch.zeros(0)
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    metrics["logprob_abs_diff_max"] = float(d[mk != 0].max()) if bool((mk != 0).any()) else 0.0
    metrics["logprob_abs_diff_mean"] = float(d[mk != 0].mean()) if bool((mk != 0).any()) else 0.0

    # importance weights old/behaviour: always reported, applied to the loss only with --use-tis
    tis = None
    if items:
        w, tis_metrics = compute_tis_weights(
            torch.cat(old_log_probs), torch.cat([it.rollout_log_probs for it in items]), mk,
            clip_high=float(args.tis_clip), clip_low=float(args.tis_clip_low),
        )
        if args.use_tis:
            tis = list(torch.split(w, [m.numel() for m in masks]))
        metrics.update(tis_metrics)
    return metrics, tis


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


@dataclass
class LossInputs:
    """One micro-batch's rollout tensors on the device, flat over its response tokens, and each token's share of
    the step's loss (`weight`: mask / tokens, or mask / (its rollout's tokens x rollouts) for sample_mean)."""

    sizes: list[int]
    mask: Tensor
    weight: Tensor
    old: Tensor | None  # None: the micro-batch's own log-probs, detached (RolloutTensors.old_log_probs is None)
    adv: Tensor
    tis: Tensor | None
    ref: Tensor | None
    behaviour: Tensor | None = None  # the tokens' rollout log-probs, for TIS weights computed in the loss

    def reduce(self, x: Tensor) -> Tensor:
        """Σ weight·x over masked tokens (a NaN off the mask never leaks); `x` is [R] or [k, R]."""
        return torch.where(self.weight != 0, x * self.weight, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


def loss_inputs(args, rt: RolloutTensors, positions: list[int], masks: list[Tensor], num_tokens: float,
                num_samples: float, device: torch.device | str, sample_tokens: list[float] | None = None,
                rollout_log_probs: list[Tensor] | None = None) -> LossInputs:
    """`micro_batch_loss`'s inputs for the items at `positions`. `sample_tokens`: each item's sample-mean
    denominator (its rollout's loss tokens; default its own); `rollout_log_probs`: needed with --use-tis when `rt`
    has no old log-probs."""
    mask = torch.cat(masks).float()
    if loss_agg_mode(args) == "token_mean":
        weight = mask / max(float(num_tokens), 1.0)
    else:
        denom = max(float(num_samples), 1e-12)
        tokens = [float(m.sum()) for m in masks] if sample_tokens is None else sample_tokens
        weight = torch.cat([m.float() / max(t, 1.0) / denom for m, t in zip(masks, tokens)])
    pick = lambda ts: None if ts is None else torch.cat([ts[p].float() for p in positions])  # noqa: E731
    behaviour = None
    if args.use_tis and rt.old_log_probs is None:
        if rollout_log_probs is None:
            raise ValueError("loss_inputs: --use-tis without old log-probs needs the items' rollout log-probs")
        behaviour = torch.cat([lp.float() for lp in rollout_log_probs])
    host = [mask, weight, pick(rt.old_log_probs), pick(rt.advantages), pick(rt.tis_weights), pick(rt.ref_log_probs),
            behaviour]
    mask, weight, old, adv, tis, ref, behaviour = to_device(host, device)
    return LossInputs([m.numel() for m in masks], mask, weight, old, adv, tis, ref, behaviour)


def micro_batch_loss(args, log_probs: Tensor, entropies: Tensor | None, inp: LossInputs
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss and metric parts (detached, on the device), both step-normalised, of one micro-batch of real items."""
    metrics: dict[str, Tensor] = {}
    old = inp.old if inp.old is not None else log_probs.detach().float()
    tis = inp.tis
    if tis is None and inp.behaviour is not None:
        tis = truncated_is_weights(old, inp.behaviour, float(args.tis_clip), float(args.tis_clip_low))[0]
    if args.loss_type == "sft_loss":
        loss = -inp.reduce(log_probs)
        metrics["sft_loss"] = loss.detach()
        return loss, metrics

    # GSPO: the sequence ratio on every token; otherwise the token ratio
    if args.advantage_estimator == "gspo":
        ratio = torch.cat(compute_gspo_ratio(list(log_probs.split(inp.sizes)), list(old.split(inp.sizes)),
                                             list(inp.mask.split(inp.sizes))))
    else:
        ratio = policy_ratio(log_probs, old)
    pg, clip = clipped_surrogate(ratio, inp.adv, args.eps_clip, args.eps_clip_high, args.eps_clip_c)
    if tis is not None:  # per token, also under GSPO (see compute_gspo_ratio)
        pg = pg * tis
    pg_loss = inp.reduce(pg)
    loss = pg_loss
    names = ["pg_clipfrac", "ppo_kl"]
    per_token = [clip, old - log_probs.detach().float()]
    if args.eps_clip_c is not None:
        names.append("pg_dual_clipfrac")
        per_token.append(dual_clip_flags(ratio, inp.adv, args.eps_clip_c))
    if entropies is not None:
        ent = inp.reduce(entropies)
        metrics["entropy"] = ent.detach()
        coef = float(args.entropy_coef)
        if coef:
            loss = loss - coef * ent
    if args.use_kl_loss:
        if inp.ref is None:
            raise RuntimeError("--use-kl-loss needs reference log-probs, but no reference model was built")
        kl_loss = inp.reduce(compute_approx_kl(log_probs, inp.ref, args.kl_loss_type))
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + float(args.kl_loss_coef) * kl_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics.update(zip(names, inp.reduce(torch.stack(per_token).detach()).unbind()))
    return loss, metrics
