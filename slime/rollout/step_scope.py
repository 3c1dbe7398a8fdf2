"""Which rollout step a plugin's generate call runs for, so that upstream's `GenerateState.aborted` can say
whether that step is aborting.

`SampleRequester.run_custom` runs the user's generate with `in_step(stop, ...)`: `stop` is the step's event,
set once the step has its batch (or failed, or was halted) and aborts the engines. A context variable, so
the tasks of each step (train_async.py may run one while the next is gated) see their own step, and a
generate outside any step (an evaluation) sees none.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Awaitable, TypeVar

T = TypeVar("T")

_STOP: ContextVar[asyncio.Event | None] = ContextVar("slime_step_stop", default=None)


async def in_step(stop: asyncio.Event | None, call: Awaitable[T]) -> T:
    """Await `call` (a plugin's generate) as part of the step whose stop event is `stop` (None: no step)."""
    token = _STOP.set(stop)
    try:
        return await call
    finally:
        _STOP.reset(token)


def step_stopping() -> bool:
    """Whether the step the running plugin call belongs to is stopping (False outside a step)."""
    stop = _STOP.get()
    return stop is not None and stop.is_set()
