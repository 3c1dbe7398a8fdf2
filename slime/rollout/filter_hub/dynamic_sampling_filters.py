"""Built-in dynamic-sampling filters: `def f(args, samples) -> DynamicFilterOutput`, upstream slime's names."""

from __future__ import annotations

import math

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample, Status


def _scalar_reward(sample: Sample, args) -> float:
    reward = sample.reward
    if isinstance(reward, dict):
        key = args.reward_key
        if not key or key not in reward:
            raise ValueError(f"sample {sample.index}: reward is a dict {sorted(reward)}; set --reward-key to one of them")
        reward = reward[key]
    return float(reward)


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a group only if its usable rewards are not all equal (DAPO's dynamic sampling); failed samples are
    left out, and a group with fewer than two usable rewards is rejected."""
    rewards = [
        _scalar_reward(s, args) for s in samples if s.reward is not None and s.status != Status.FAILED
    ]
    if not rewards:
        return DynamicFilterOutput(keep=False, reason="all samples failed")
    first = rewards[0]
    if all(math.isclose(r, first, rel_tol=0.0, abs_tol=1e-12) for r in rewards):
        return DynamicFilterOutput(keep=False, reason=f"all rewards equal (={first:g})")
    return DynamicFilterOutput(keep=True)


def check_reward_nonzero_std_with_fallback(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a rejected group is kept when the step would otherwise run short of groups
    (`keep_when_insufficient`): prefer groups with spread without sampling more."""
    out = check_reward_nonzero_std(args, samples)
    out.keep_when_insufficient = True
    return out
