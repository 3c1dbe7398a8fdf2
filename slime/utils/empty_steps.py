"""Steps that would train nothing (every group failed): skipped without a version bump, counted, and the run
stopped with the failures' common cause after `--max-consecutive-empty-steps` in a row."""

from __future__ import annotations

import logging
from collections import Counter

from slime.utils.ledger import reason_category
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class EmptyStepsError(RuntimeError):
    """Too many consecutive steps had no trainable sample; the message names the common cause."""


def count_trainable(groups: list[list[Sample]]) -> int:
    return sum(1 for g in groups for s in g if s.status is not Status.FAILED)


class EmptySteps:
    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.total = 0
        self._reasons: Counter = Counter()

    def trained(self) -> None:
        self.in_a_row = 0
        self._reasons.clear()

    def skipped(self, rollout_id: int, dropped: dict[int, str]) -> None:
        """Record an empty step; raise `EmptyStepsError` when it is the `limit`-th in a row."""
        self.in_a_row += 1
        self.total += 1
        self._reasons.update(dropped.values())
        logger.warning("rollout %d: no trainable sample (%d groups dropped: %s); skipping the update, policy version "
                       "unchanged (%d/%d empty steps in a row)", rollout_id, len(dropped), self._summary(Counter(dropped.values())),
                       self.in_a_row, self.limit)
        if self.in_a_row >= self.limit:
            raise EmptyStepsError(f"{self.in_a_row} rollout steps in a row trained nothing (--max-consecutive-empty-steps "
                                  f"{self.limit}): {self.common_cause()}")

    def common_cause(self) -> str:
        if not self._reasons:
            return "no groups were returned (data exhausted?)"
        by_category: Counter = Counter()
        for reason, n in self._reasons.items():
            by_category[reason_category(reason)] += n
        category, n = by_category.most_common(1)[0]
        example = max((r for r in self._reasons if reason_category(r) == category), key=self._reasons.__getitem__)
        return (f"{n} of {sum(self._reasons.values())} groups dropped for {category} "
                f"(most often: {example!r})")

    @staticmethod
    def _summary(reasons: Counter) -> str:
        cats: Counter = Counter()
        for r, n in reasons.items():
            cats[reason_category(r)] += n
        return ", ".join(f"{c}: {n}" for c, n in cats.most_common()) or "none"
