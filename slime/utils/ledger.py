"""The ledger: exactly one state per prompt group, every transition validated.

    (new) ──issue──▶ issued ──▶ parked ──issue──▶ issued ...
                        │          └──▶ dropped(reason)
                        ├──▶ finished ──▶ trained   (final)
                        │        └──────▶ dropped(reason)
                        └──▶ dropped(reason)        (final)

Data rows dropped at load are recorded apart (`drop_rows`), so an audit accounts for every row as well."""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable

from slime.utils.types import Sample, Status

ISSUED, PARKED, FINISHED, TRAINED, DROPPED = "issued", "parked", "finished", "trained", "dropped"
STATES = (ISSUED, PARKED, FINISHED, TRAINED, DROPPED)
_NEW = None
# allowed transitions: from-state -> set of to-states (None = never seen before)
TRANSITIONS: dict[str | None, frozenset[str]] = {
    _NEW: frozenset({ISSUED}),
    ISSUED: frozenset({PARKED, FINISHED, DROPPED}),
    PARKED: frozenset({ISSUED, DROPPED}),
    FINISHED: frozenset({TRAINED, DROPPED}),
    TRAINED: frozenset(),
    DROPPED: frozenset(),
}


class LedgerError(ValueError):
    """An invalid state transition or an unbalanced ledger; the message names the group(s)."""


class Ledger:
    """Exactly one state per prompt-group id; transitions validated."""

    def __init__(self) -> None:
        self._state: dict[int, str] = {}
        self._reason: dict[int, str] = {}
        self._rows_dropped: dict[int, str] = {}  # data rows dropped at load (0-based row -> reason)

    def state(self, group_id: int) -> str | None:
        return self._state.get(int(group_id))

    def reason(self, group_id: int) -> str | None:
        return self._reason.get(int(group_id))

    def mark(self, group_ids: Iterable[int], state: str, reason: str | None = None) -> None:
        """Move every id to `state`; all-or-nothing (nothing changes if one transition is invalid)."""
        if state not in STATES:
            raise LedgerError(f"unknown ledger state {state!r}; expected one of {STATES}")
        if state == DROPPED and not reason:
            raise LedgerError("dropping a group needs a reason")
        if state != DROPPED and reason is not None:
            raise LedgerError(f"a reason ({reason!r}) is only valid with state 'dropped', not {state!r}")
        ids = [int(g) for g in group_ids]
        dup = [g for g, c in Counter(ids).items() if c > 1]
        if dup:
            raise LedgerError(f"group ids {dup} appear more than once in one mark({state!r}) call")
        bad = [(g, self._state.get(g)) for g in ids if state not in TRANSITIONS[self._state.get(g)]]
        if bad:
            desc = ", ".join(f"group {g}: {old or 'new'} -> {state}" for g, old in bad[:10])
            raise LedgerError(f"invalid ledger transition(s) ({len(bad)}): {desc}")
        for g in ids:
            self._state[g] = state
            if reason is not None:
                self._reason[g] = reason

    def drop_rows(self, reasons: dict[int, str]) -> None:
        """The data rows the data source dropped at load this run (0-based row -> `category: detail`); replaces
        the record (a resumed run may drop differently, e.g. with a new --rollout-max-prompt-len)."""
        blank = [r for r, why in reasons.items() if not why]
        if blank:
            raise LedgerError(f"dropping data rows needs a reason (rows {sorted(blank)[:10]} have none)")
        self._rows_dropped = {int(r): str(why) for r, why in reasons.items()}

    def rows_dropped(self) -> dict[int, str]:
        return dict(self._rows_dropped)

    def ids_in(self, state: str) -> list[int]:
        return sorted(g for g, s in self._state.items() if s == state)

    def summary(self) -> dict[str, int]:
        """Counts per state, per drop reason category (`dropped/<category>`, see `reason_category`), and the total."""
        counts = Counter(self._state.values())
        out = {s: counts.get(s, 0) for s in STATES}
        for g, r in self._reason.items():
            if self._state[g] == DROPPED:
                key = f"dropped/{reason_category(r)}"
                out[key] = out.get(key, 0) + 1
        out["total"] = len(self._state)
        out["rows_dropped"] = len(self._rows_dropped)
        return out

    def check_balanced(self, parked_ids: Iterable[int], ready_ids: Iterable[int], idle: bool = True) -> dict[str, int]:
        """Raise `LedgerError` unless the ledger agrees with the buffer (`idle`: nothing may be issued)."""
        parked, ready = list(parked_ids), list(ready_ids)
        problems = []
        for name, ids in (("parked", parked), ("ready", ready)):
            dup = [g for g, c in Counter(ids).items() if c > 1]
            if dup:
                problems.append(f"{name} groups held twice: {dup[:10]}")
        both = set(parked) & set(ready)
        if both:
            problems.append(f"groups held both parked and ready: {sorted(both)[:10]}")
        ledger_parked = set(self.ids_in(PARKED))
        if ledger_parked != set(parked):
            problems.append(
                f"ledger parked but not held: {sorted(ledger_parked - set(parked))[:10]}; "
                f"held parked but ledger says otherwise: {sorted(set(parked) - ledger_parked)[:10]}"
            )
        not_fin = [g for g in ready if self._state.get(g) != FINISHED]
        if not_fin:
            problems.append(f"ready groups not 'finished' in the ledger: {not_fin[:10]}")
        if idle and self.ids_in(ISSUED):
            problems.append(f"groups still issued between steps (lost?): {self.ids_in(ISSUED)[:10]}")
        if problems:
            raise LedgerError("ledger unbalanced: " + "; ".join(problems))
        return self.summary()

    def state_dict(self) -> dict[str, Any]:
        return {"state": {str(g): s for g, s in self._state.items()}, "reason": {str(g): r for g, r in self._reason.items()},
                "rows_dropped": {str(r): why for r, why in self._rows_dropped.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        state = {int(g): s for g, s in d["state"].items()}
        bad = {g: s for g, s in state.items() if s not in STATES}
        if bad:
            raise LedgerError(f"ledger state_dict has unknown states: {dict(list(bad.items())[:10])}")
        self._state = state
        self._reason = {int(g): r for g, r in d.get("reason", {}).items()}
        self._rows_dropped = {int(r): why for r, why in d.get("rows_dropped", {}).items()}


def group_id(group: list[Sample]) -> int:
    """The prompt-group id of `group`; every member must share it."""
    if not group:
        raise ValueError("empty group (no samples)")
    ids = {s.group_index for s in group}
    if len(ids) != 1 or None in ids:
        raise ValueError(f"group members disagree on group_index (or it is unset): {sorted(map(str, ids))}")
    return int(group[0].group_index)


def is_group_finished(group: list[Sample]) -> bool:
    return all(s.status.is_finished for s in group)


def reason_category(reason: str) -> str:
    """A drop reason's category, the part before its first ':' (metrics and summaries count categories)."""
    return reason.split(":", 1)[0].strip() or reason


def sample_failure(sample: Sample) -> str:
    """Why a FAILED sample failed, as a drop reason: `reward_failed: ...`, `engine_refused: ...`, `tool: <name>: ...`
    (a multi-turn sample's tool raised, hung, died or returned garbage), or `failed: ...`."""
    failure = str(sample.metadata.get("failure") or "unknown") if isinstance(sample.metadata, dict) else "unknown"
    if failure.startswith("reward: "):
        return "reward_failed: " + failure[len("reward: "):]
    if failure.startswith(("engine_refused: ", "tool: ")):
        return failure
    return "failed: " + failure


def group_failure_reason(group: list[Sample]) -> str | None:
    """The drop reason of a group with no trainable sample (every member FAILED), else None."""
    if not group or any(s.status is not Status.FAILED for s in group):
        return None
    return sample_failure(group[0])
