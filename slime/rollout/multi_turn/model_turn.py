"""One model turn: what the agent asks of the rollout's engines, and what comes back.

A `ModelTurn` is `async (sample, sampling_params) -> Segment`: one `POST /generate` with the sample's token ids
so far (a resumed turn continues from its last token, never re-tokenised text) and the turn's sampling params;
it appends nothing (the agent does). The rollout provides it: `SampleRequester.turn`, the same request path
as a single-turn sample's (request id, version checks, counters), or through train_async.py's version gate
`GatedRequester`'s turn (slime/rollout/sampling_request.py, slime/rollout/version_gate.py). A request the
engine refuses (HTTP 4xx) raises `TurnRefused`; the agent fails the sample `engine_refused: <message>`. A turn
the rollout stopped before sending it (the step ended, or the gate sent the sample back to have the staleness
cap applied) comes back as an empty `abort` segment: the agent parks the sample as it is.
"""

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
