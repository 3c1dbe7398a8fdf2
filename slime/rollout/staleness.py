"""Staleness cap for resumed partial trajectories (`--max-staleness`, `--staleness-policy`).

Every response token carries the policy version that produced it. When a
parked group is handed out again at policy version `current`, an unfinished
member whose oldest token is older than `current - max_staleness` is handled
by the policy:

- `restart`: drop its response and generate it again from the prompt;
- `mask`: keep the tokens as context but zero the loss mask of the stale ones
  (`Sample.mask_tokens_older_than`);
- `keep`: keep everything and rely on importance-sampling correction (TIS).

Finished members are final and never touched. Each case is counted.

`apply_to_sample` does the same for one sample resumed in flight (train_async.py: after a weight
update, see `version_gate.py`); `check_before_training` applies the cap once more to a batch about to be
trained (stream mode: a group may wait for the trainer after its last resume).
"""

from __future__ import annotations

import logging
from collections import Counter

from slime.utils.types import Sample

logger = logging.getLogger(__name__)

POLICIES = ("restart", "mask", "keep")


def is_stale(sample: Sample, current_version: int, max_staleness: int | None) -> bool:
    """True if an unfinished sample has a token older than `current_version - max_staleness`."""
    if max_staleness is None or sample.status.is_finished:
        return False
    oldest = sample.oldest_version()
    return oldest is not None and oldest < current_version - max_staleness


def apply_to_sample(sample: Sample, current_version: int, max_staleness: int | None, policy: str) -> Counter:
    """`apply_staleness_policy` for one unfinished sample (resumed in flight); same counts."""
    if policy not in POLICIES:
        raise ValueError(f"--staleness-policy {policy!r} is not one of {POLICIES}")
    counts: Counter = Counter()
    if not is_stale(sample, current_version, max_staleness):
        return counts
    counts["stale_samples_in_flight"] += 1
    counts[policy] += 1
    if policy == "restart":
        counts["restarted_tokens"] += sample.response_length
        sample.reset_response()
        sample.metadata["staleness_restarts"] = sample.metadata.get("staleness_restarts", 0) + 1
    elif policy == "mask":
        counts["masked_tokens"] += sample.mask_tokens_older_than(current_version - max_staleness)
    return counts


def check_before_training(groups: list[list[Sample]], train_version: int, max_staleness: int | None,
                          policy: str) -> tuple[list[list[Sample]], list[list[Sample]], Counter]:
    """(kept, stale, counts): the cap applied to finished groups about to be trained at `train_version`.

    A loss-masked token older than `train_version - max_staleness` makes its group stale: `restart`
    returns it in `stale` (a finished group cannot be regenerated: the caller drops it), `mask` zeroes
    those tokens' loss mask and keeps the group, `keep` keeps it (TIS corrects it).
    """
    if policy not in POLICIES:
        raise ValueError(f"--staleness-policy {policy!r} is not one of {POLICIES}")
    counts: Counter = Counter()
    if max_staleness is None:
        return list(groups), [], counts
    min_version = train_version - max_staleness
    kept, stale = [], []
    for group in groups:
        old = sum(1 for s in group for v, m in zip(s.weight_versions, s.loss_mask) if m and v < min_version)
        if not old:
            kept.append(group)
            continue
        counts["stale_groups_at_train"] += 1
        if policy == "restart":
            stale.append(group)
        elif policy == "mask":
            counts["masked_tokens_at_train"] += sum(s.mask_tokens_older_than(min_version) for s in group)
            kept.append(group)
        else:
            kept.append(group)
    return kept, stale, counts


def apply_staleness_policy(
    groups: list[list[Sample]], current_version: int, max_staleness: int | None, policy: str
) -> Counter:
    """Apply `policy` in place to stale unfinished samples of resumed `groups`; return counts.

    Keys: `restart`, `mask`, `keep` (samples handled each way), `masked_tokens`,
    `restarted_tokens` (response tokens thrown away), `stale_groups`.
    """
    if policy not in POLICIES:
        raise ValueError(f"--staleness-policy {policy!r} is not one of {POLICIES}")
    counts: Counter = Counter()
    if max_staleness is None:
        return counts
    min_version = current_version - max_staleness
    for group in groups:
        stale = [s for s in group if is_stale(s, current_version, max_staleness)]
        if not stale:
            continue
        counts["stale_groups"] += 1
        for s in stale:
            counts[policy] += 1
            if policy == "restart":
                counts["restarted_tokens"] += s.response_length
                s.reset_response()
                s.metadata["staleness_restarts"] = s.metadata.get("staleness_restarts", 0) + 1
            elif policy == "mask":
                counts["masked_tokens"] += s.mask_tokens_older_than(min_version)
    if counts["stale_groups"]:
        logger.info("staleness (current v%d, max lag %d, policy %s): %s", current_version, max_staleness, policy, dict(counts))
    return counts
