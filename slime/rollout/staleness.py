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
