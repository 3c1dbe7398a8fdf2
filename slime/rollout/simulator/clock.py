"""asyncio on a simulated clock: the real rollout step runs on it against the simulated engines.

`VirtualTimeLoop` is asyncio's selector loop whose `time()` jumps to the next timer when nothing is ready, so
everything scheduled through it happens in simulated time, in order. `run_virtual(coro)` runs one on a fresh loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import selectors

# how long the loop waits when nothing at all is scheduled: that long means the simulation deadlocked
STALL_WAIT_S = 60.0


class _Tick(float):
    """A timer's due time that orders equal times by when they were scheduled (asyncio's compare the time only)."""

    def __new__(cls, when: float, seq: int):
        tick = super().__new__(cls, when)
        tick.seq = seq
        return tick

    def __lt__(self, other):
        if isinstance(other, _Tick) and float.__eq__(self, other):
            return self.seq < other.seq
        return float.__lt__(self, other)


class _JumpSelector(selectors.DefaultSelector):
    """Answers at once; a wait for the next timer moves the loop's clock there instead."""

    def __init__(self):
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout=None):
        # (another thread's call fills the ready queue itself; the self-pipe is read only when nothing is scheduled)
        if timeout == 0:
            return []
        if timeout is None:  # nothing scheduled, nothing ready: only another thread can go on
            events = super().select(STALL_WAIT_S)
            if not events:
                raise RuntimeError(f"simulation stalled: nothing scheduled for {STALL_WAIT_S:.0f}s of wall time "
                                   "(a coroutine waits for something no simulated event will do)")
            return events
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0):
        selector = _JumpSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = float(start)
        self._tick = itertools.count()

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def call_at(self, when, callback, *args, context=None):
        return super().call_at(_Tick(when, next(self._tick)), callback, *args, context=context)


def run_virtual(coro, start: float = 0.0):
    """Run `coro` on a fresh `VirtualTimeLoop` and return its result (on a worker thread if this one runs a loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coro, start)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="simulation") as pool:
        return pool.submit(_run, coro, start).result()


def _run(coro, start: float):
    loop = VirtualTimeLoop(start)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


__all__ = ["VirtualTimeLoop", "run_virtual"]
