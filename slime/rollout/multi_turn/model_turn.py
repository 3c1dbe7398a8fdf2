"""One model turn over SGLang's HTTP API: `POST /generate` with the sample's token ids, nothing appended.

`HttpModelTurn(session, url, policy_version)` is a `ModelTurn` (slime/rollout/multi_turn/agent.py): it sends
the sample's tokens so far (a resumed turn continues from its last token, never re-tokenised text) with the
turn's sampling params and returns the reply as a `Segment` (ids, log-probs, per-token versions, text, how it
ended), read by the same parser as single-turn requests (`sampling_request.parse_segment`). A request the
engine refuses (HTTP 4xx) raises `TurnRefused`; the agent fails the sample `engine_refused: <message>`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

from slime.backends.sglang_utils import http_client
from slime.rollout.sampling_request import parse_segment
from slime.utils.types import Sample


@dataclass
class Segment:
    """One /generate reply: the tokens it added and how it ended (stop | length | abort)."""

    ids: list[int]
    log_probs: list[float]
    versions: int | list[int]
    text: str
    finish: str


# sends one request for `sample` (its tokens so far) with these sampling params; appends nothing
ModelTurn = Callable[[Sample, dict], Awaitable[Segment]]


class TurnRefused(RuntimeError):
    """The engine refused the turn's request (HTTP 4xx); the message is the engine's reason."""


class HttpModelTurn:
    def __init__(self, session, url: str, policy_version: int, timeout: float = 1800.0, rid_prefix: str = "turn"):
        self.session, self.url, self.policy_version = session, url, int(policy_version)
        self.timeout, self.rid_prefix = float(timeout), rid_prefix
        self.requests = 0

    async def __call__(self, sample: Sample, sampling_params: dict) -> Segment:
        rid = f"{self.rid_prefix}-g{sample.group_index}-s{sample.index}-{uuid.uuid4().hex[:12]}"
        payload = {"input_ids": list(sample.tokens), "sampling_params": sampling_params, "return_logprob": True,
                   "rid": rid}
        self.requests += 1
        try:
            out = await http_client.generate(self.session, self.url, payload, timeout=self.timeout)
        except http_client.EngineHTTPError as e:
            if e.is_refusal:
                raise TurnRefused(e.message) from e
            raise
        ids, lps, versions, text, finish = parse_segment(out, self.url)
        return Segment(ids, lps, self.policy_version if versions is None else versions, text, finish)
