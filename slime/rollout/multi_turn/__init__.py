"""Multi-turn tool-use rollouts that survive abort and resume (APRIL for agents; docs/multi-turn.md).

`generate` is the built-in `--custom-generate-function-path`; it runs the sample with the rollout's `ToolAgent`,
which lives across steps, so a tool call left pending by an abort is picked up, not re-run."""

from __future__ import annotations

import asyncio
import contextlib
from contextvars import ContextVar
from dataclasses import dataclass

from slime.rollout.multi_turn.agent import ToolAgent
from slime.rollout.multi_turn.model_turn import ModelTurn
from slime.utils.types import Sample


@dataclass
class AgentScope:
    """What `generate` runs with during one rollout step."""

    agent: ToolAgent
    model: ModelTurn  # one request per model turn through the step's engines
    stop: asyncio.Event | None = None  # set when the step stops: a sample waiting on a tool parks at once


_SCOPE: ContextVar[AgentScope | None] = ContextVar("slime_multi_turn_scope", default=None)


@contextlib.contextmanager
def agent_scope(scope: AgentScope):
    """Make `scope` the one `generate` uses in this context (a rollout step's event loop and its tasks)."""
    token = _SCOPE.set(scope)
    try:
        yield scope
    finally:
        _SCOPE.reset(token)


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    scope = _SCOPE.get()
    if scope is None:
        raise RuntimeError("slime.rollout.multi_turn.generate runs inside a rollout step that provides its agent "
                           "(--agent-env names the environment); no agent_scope is active here")
    return await scope.agent.run(sample, sampling_params, scope.model, scope.stop)


__all__ = ["AgentScope", "ToolAgent", "agent_scope", "generate"]
