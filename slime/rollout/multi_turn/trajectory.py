"""The record of a multi-turn trajectory, kept on its Sample (`sample.metadata["agent"]`, plain JSON).

    {"turns": [{"kind": "model", "start": 0, "end": 6, "end_reason": "call"},
               {"kind": "tool", "start": 6, "end": 8, "call": 0},
               {"kind": "model", "start": 8, "end": 11, "end_reason": None}],      # open: aborted mid-turn
     "calls": [{"id": "9f..", "name": "calculator", "arguments": "37-5", "state": "done",
                "seconds": 0.004, "error": None, "truncated": False, "reran": False}]}

A call is `pending` (sent, no observation yet), `done`, `bad_call` or `failed`; the record travels with the sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample

KEY = "agent"


class TrajectoryError(ValueError):
    """The record does not describe the sample's response (edited by something else)."""


@dataclass
class Trajectory:
    sample: Sample

    @classmethod
    def of(cls, sample: Sample) -> "Trajectory":
        """The sample's record (created or reset to match its response); inconsistent: TrajectoryError."""
        rec = sample.metadata.get(KEY)
        if rec is None or sample.response_length == 0:
            sample.metadata[KEY] = {"turns": [], "calls": []}
            return cls(sample)
        covered = rec["turns"][-1]["end"] if rec["turns"] else 0
        if covered != sample.response_length:
            raise TrajectoryError(f"sample {sample.index}: its multi-turn record covers {covered} response tokens, "
                                  f"the response has {sample.response_length} (was it grown outside the multi-turn "
                                  "generate?)")
        return cls(sample)

    @property
    def record(self) -> dict[str, Any]:
        return self.sample.metadata[KEY]

    @property
    def turns(self) -> list[dict[str, Any]]:
        return self.record["turns"]

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self.record["calls"]

    # ---- reading --------------------------------------------------------------------
    def open_turn(self) -> dict[str, Any] | None:
        last = self.turns[-1] if self.turns else None
        return last if last is not None and last["kind"] == "model" and last["end_reason"] is None else None

    def pending_call(self) -> dict[str, Any] | None:
        return self.calls[-1] if self.calls and self.calls[-1]["state"] == "pending" else None

    def model_turns(self) -> int:
        return sum(1 for t in self.turns if t["kind"] == "model")

    # ---- growing (the caller appends the tokens to the sample first) ------------------
    def model_tokens_added(self, n: int) -> None:
        """The sample grew by `n` model tokens: the open turn grows, or a new one opens."""
        end = self.sample.response_length
        turn = self.open_turn()
        if turn is None:
            turn = {"kind": "model", "start": end - n, "end": end - n, "end_reason": None}
            self.turns.append(turn)
        turn["end"] = end
        self._check()

    def close_turn(self, reason: str) -> None:
        turn = self.open_turn()
        if turn is None:
            raise TrajectoryError(f"sample {self.sample.index}: no open model turn to close ({reason})")
        turn["end_reason"] = reason

    def begin_call(self, call_id: str, name: str | None, arguments: Any, state: str = "pending") -> dict[str, Any]:
        call = {"id": call_id, "name": name, "arguments": arguments, "state": state, "seconds": 0.0, "error": None,
                "truncated": False, "reran": False}
        self.calls.append(call)
        return call

    def observation_added(self, n: int) -> None:
        end = self.sample.response_length
        self.turns.append({"kind": "tool", "start": end - n, "end": end, "call": len(self.calls) - 1})
        self._check()

    def _check(self) -> None:
        prev = 0
        for t in self.turns:
            if t["start"] != prev or t["end"] < t["start"]:
                raise TrajectoryError(f"sample {self.sample.index}: multi-turn record broken at {t}")
            prev = t["end"]
        if prev != self.sample.response_length:
            raise TrajectoryError(f"sample {self.sample.index}: record covers {prev} tokens of "
                                  f"{self.sample.response_length}")
