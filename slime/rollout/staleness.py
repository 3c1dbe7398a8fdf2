"""The staleness cap (`--max-staleness`, `--staleness-policy`): a token older than `train_version - max_staleness`
is regenerated (`restart`; the length guard masks instead after a budget), masked (`mask`) or kept (`keep`)."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from slime.rollout.length_bias import CUT_KEY

logger = logging.getLogger(__name__)

POLICIES = ("restart", "mask", "keep")
# The length guard: how often `restart` may regenerate one sample before its stale tokens are masked instead
# (restarts drop the long tail: benchmarks/README.md).
GUARD_RESTART_BUDGET = 0
# what the sites count (their Counters' names): samples by policy, tokens, groups
STEP_COUNTS = (*POLICIES, "masked_tokens", "restarted_tokens", "stale_groups", "stale_groups_at_train",
               "masked_tokens_at_train", "guard_masked", "guard_masked_groups_at_train")  # a step's sites
IN_FLIGHT_COUNTS = (*POLICIES, "masked_tokens", "restarted_tokens", "stale_samples_in_flight",
                    "guard_masked")  # at_resume_in_flight


@dataclass(frozen=True)
class StalenessCap:
    max_staleness: int | None = None  # None: no cap
    policy: str = "restart"
    restart_budget: int | None = None  # restart: restarts a sample may take before it is masked (None: unbounded)

    def __post_init__(self):  # the one check of both values
        if self.policy not in POLICIES:
            raise ValueError(f"--staleness-policy: {self.policy!r} is not one of {POLICIES}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"--max-staleness: must be >= 0, got {self.max_staleness}")
        if self.restart_budget is not None and self.restart_budget < 0:
            raise ValueError(f"restart budget: must be >= 0, got {self.restart_budget}")

    @classmethod
    def from_args(cls, args) -> "StalenessCap":
        """The run's cap; with `restart` the length guard gives each sample `GUARD_RESTART_BUDGET` restarts."""
        guarded = args.staleness_policy == "restart" and not args.disable_length_guard
        return cls(args.max_staleness, args.staleness_policy, GUARD_RESTART_BUDGET if guarded else None)

    @property
    def guarded(self) -> bool:  # the length guard can act: a cap, `restart`, a restart budget
        return self.max_staleness is not None and self.policy == "restart" and self.restart_budget is not None

    def floor(self, train_version: int) -> int | None:
        """The oldest version a token trained at `train_version` may have (None: no cap)."""
        return None if self.max_staleness is None else train_version - self.max_staleness

    def is_stale(self, sample, train_version: int) -> bool:
        """A sample holding a token older than the floor: any token of an unfinished sample (context for what
        comes next), a token still in the loss of a finished one (it trains with its resumed group)."""
        floor = self.floor(train_version)
        if floor is None:
            return False
        if sample.status.is_finished:
            return sample.loss_tokens_older_than(floor) > 0
        oldest = sample.oldest_version()
        return oldest is not None and oldest < floor

    def _policy_for(self, sample) -> str:
        """The policy, except that a sample which spent its restart budget is masked (the length guard)."""
        if self.policy == "restart" and self.restart_budget is not None \
                and sample.metadata.get("staleness_restarts", 0) >= self.restart_budget:
            return "mask"
        return self.policy

    def _apply(self, sample, floor: int, counts: Counter) -> None:
        policy = self._policy_for(sample)
        counts[policy] += 1
        if policy != self.policy:
            counts["guard_masked"] += 1
        if policy == "restart":
            counts["restarted_tokens"] += sample.response_length
            sample.metadata.setdefault(CUT_KEY, sample.response_length)  # its first attempt was at least this long
            sample.reset_response()
            sample.metadata["staleness_restarts"] = sample.metadata.get("staleness_restarts", 0) + 1
        elif policy == "mask":
            counts["masked_tokens"] += sample.mask_tokens_older_than(floor)

    # ---- the sites ---------------------------------------------------------------------------
    def at_resume(self, groups: list[list], train_version: int) -> Counter:
        """The policy applied in place to the stale members of parked `groups` handed out again; counts `restart`
        / `mask` / `keep` (samples), `masked_tokens`, `restarted_tokens`, `stale_groups`."""
        counts: Counter = Counter()
        floor = self.floor(train_version)
        if floor is None:
            return counts
        for group in groups:
            stale = [s for s in group if self.is_stale(s, train_version)]
            if stale:
                counts["stale_groups"] += 1
            for s in stale:
                self._apply(s, floor, counts)
        if counts:
            logger.info("staleness (train version v%d, max lag %d, policy %s): %s", train_version, self.max_staleness,
                        self.policy, dict(counts))
        return counts

    def at_resume_in_flight(self, sample, train_version: int) -> Counter:
        """`at_resume` for one unfinished sample sent again within a running step; adds `stale_samples_in_flight`."""
        counts: Counter = Counter()
        if self.is_stale(sample, train_version):
            counts["stale_samples_in_flight"] += 1
            self._apply(sample, self.floor(train_version), counts)
        return counts

    def before_training(self, groups: list[list], train_version: int) -> tuple[list[list], list[list], Counter]:
        """(kept, stale, counts) for finished groups about to be trained at `train_version` (`restart`: stale
        groups returned, the caller drops them; `mask`: stale tokens leave the loss)."""
        counts: Counter = Counter()
        floor = self.floor(train_version)
        if floor is None:
            return list(groups), [], counts
        kept, stale = [], []
        for group in groups:
            if any(s.loss_tokens_older_than(floor) for s in group):
                counts["stale_groups_at_train"] += 1
                policy = self.policy
                if policy == "restart" and any(self._policy_for(s) == "mask" for s in group):
                    policy = "mask"  # the guard: a member spent its restart budget, so the group is not dropped
                    counts["guard_masked_groups_at_train"] += 1
                if policy == "restart":
                    stale.append(group)
                    continue
                if policy == "mask":
                    counts["masked_tokens_at_train"] += sum(s.mask_tokens_older_than(floor) for s in group)
            kept.append(group)
        return kept, stale, counts

    def restart_floor(self, train_version: int) -> int | None:
        """With requests running across an in-place update: the version below which a request's sample must be
        aborted and restarted (restart policy only; None: nothing to abort, as when the guard restarts nothing)."""
        return self.floor(train_version) if self.policy == "restart" and self.restart_budget != 0 else None


__all__ = ["GUARD_RESTART_BUDGET", "IN_FLIGHT_COUNTS", "POLICIES", "STEP_COUNTS", "StalenessCap"]
