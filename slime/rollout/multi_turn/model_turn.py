"""One model turn: one `POST /generate` from the sample's token ids, through the rollout's own request path.

It appends nothing (the agent does). A 4xx raises `TurnRefused`; a turn stopped before sending is an empty abort."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable

from slime.utils.types import Sample


@dataclass
class Segment:
    """One /generate reply: the tokens it added and how it ended (stop | length | abort)."""

    ids: list[int]
    log_probs: list[float]
    versions: int | list[int]
    text: str
    finish: str

    @classmethod
    def not_sent(cls, version: int) -> "Segment":
        """A turn the rollout stopped before sending it: nothing added, the sample parks."""
        return cls([], [], int(version), "", "abort")


# sends one request for `sample` (its tokens so far) with these sampling params; appends nothing
ModelTurn = Callable[[Sample, dict], Awaitable[Segment]]


class TurnRefused(RuntimeError):
    """The engine refused the turn's request (HTTP 4xx); the message is the engine's reason."""
