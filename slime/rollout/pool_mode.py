"""Pool mode's supply loop (`--rollout-mode pool`, CoPRIS-style concurrency control).

`SamplePool(size, ...)` runs `size` workers; each takes the next unfinished
sample from a shared queue and generates it, so exactly `size` requests stay
in flight for the whole step instead of whole chunks being submitted and
drained. When the queue is empty, one worker refills it through `fetch(num)`
(parked groups first, then fresh ones: the rollout step's group supply) while
the others wait for it, so groups are never over-fetched. The first fetch asks
for enough groups to fill the whole pool in one buffer round trip (each is a
Ray call); later top-ups take one group at a time.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Awaitable, Callable

# fetch(num) -> [(group state, sample), ...]: the unfinished members of up to `num` groups
Fetch = Callable[[int], Awaitable[list[tuple[Any, Any]]]]
Run = Callable[[Any, Any], Awaitable[None]]


class SamplePool:
    def __init__(self, size: int, first_fetch: int, fetch: Fetch, run: Run, stop: asyncio.Event,
                 exhausted: Callable[[], bool], fail: Callable[[str], None]):
        self.size, self.fetch, self.run, self.stop = size, fetch, run, stop
        self.exhausted, self.fail = exhausted, fail
        self._next_fetch = max(1, first_fetch)
        self._queue: deque[tuple[Any, Any]] = deque()
        self._refill = asyncio.Lock()

    def start(self) -> list[asyncio.Task]:
        """Start the workers; each returns when the step stops, the data run out, or a fetch fails."""
        return [asyncio.create_task(self._worker()) for _ in range(self.size)]

    async def _next_item(self) -> tuple[Any, Any] | None:
        while not self._queue:
            if self.stop.is_set() or self.exhausted():
                return None
            async with self._refill:  # one worker refills; the others then find the queue full
                if self._queue:
                    break
                num, self._next_fetch = self._next_fetch, 1
                self._queue.extend(await self.fetch(num))
        return self._queue.popleft()

    async def _worker(self) -> None:
        while not self.stop.is_set():
            try:
                item = await self._next_item()
            except Exception as e:
                self.fail(f"fetching groups: {type(e).__name__}: {e}")
                return
            if item is None or self.stop.is_set():
                return
            await self.run(*item)
