"""A polite stop: SIGTERM, SIGINT or a time limit ends the run at its next safe point (docs/faults.md).

The first signal records the request (a rollout step takes it as its `halt`); a second raises `StopNow` at once;
a third is no longer caught. Also `--exit-duration-in-mins` and `--exit-interval`, Megatron-LM's flags."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_name(signum: int) -> str:
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


class StopNow(KeyboardInterrupt):
    """A second stop signal: the run ends at once (its parts shut down), nothing more saved. A KeyboardInterrupt,
    so that every layer that lets Ctrl-C through (asyncio, Ray's waits) lets it through."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StoppedOnRequest(Exception):
    """The run stopped where it was asked to, its parts shut down (and checkpointed, with --save): the message
    names why and what `--load` resumes; `exit_code` is 128 + the signal's number, 0 for a time limit."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class GracefulStop:
    def __init__(self, exit_duration_in_mins: float | None = None):
        self.reason: str | None = None  # why the stop was requested (None: it was not)
        self.exit_code = 0
        self.signals = 0  # stop signals received
        self.at_once: StopNow | None = None  # what the second one raised (Ray's waits re-raise a plain KeyboardInterrupt)
        self._deadline_s = exit_duration_in_mins * 60.0 if exit_duration_in_mins else None
        self._started = time.monotonic()
        self._timer: threading.Timer | None = None
        self._handling = False  # the handlers are ours (inside `with`, until a second signal)
        self._previous: dict[int, object] = {}
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    # ---- the state -----------------------------------------------------------------------------
    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str, exit_code: int = 0) -> None:
        """Stop at the next safe point (the first request's reason and exit code are kept). Safe in a signal
        handler and from any thread: it takes no lock, and wakes the waiters through their loops."""
        if self.reason is not None:
            return
        self.exit_code, self.reason = exit_code, reason  # the reason last: `requested` implies the exit code
        for loop, fut in list(self._waiters):
            loop.call_soon_threadsafe(_resolve, fut)

    # a rollout step's `halt`: it stops as at its target once this is set
    def is_set(self) -> bool:
        return self.requested

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        waiter = (loop, loop.create_future())
        self._waiters.append(waiter)
        try:
            if not self.requested:  # (checked after registering: a request in between resolves the future)
                await waiter[1]
        finally:
            self._waiters.remove(waiter)

    # ---- the handlers and the time limit ----------------------------------------------------------
    def __enter__(self) -> "GracefulStop":
        self._handling = True
        self.install()
        if self._deadline_s is not None:
            self._timer = threading.Timer(max(0.0, self._deadline_s - (time.monotonic() - self._started)),
                                          self._time_is_up)
            self._timer.daemon = True
            self._timer.start()
        return self

    def __exit__(self, *exc) -> bool:
        if self._timer is not None:
            self._timer.cancel()
        self._restore()
        return False

    def install(self) -> None:
        """(Re)install the handlers: inside `with`, in the main thread (else nothing)."""
        if not self._handling or threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            previous = signal.signal(signum, self._on_signal)
            self._previous.setdefault(signum, previous)

    def _restore(self) -> None:
        self._handling = False
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        self.signals += 1
        name = signal_name(signum)
        if self.signals == 1:
            self.request(f"{name} received", 128 + signum)
            logger.warning("%s received: stopping at the next safe point (the rollout halted, a training call or "
                           "weight push finished), then checkpointing; send it again to stop at once", name)
            return
        self._restore()  # a third signal is not caught
        self.at_once = StopNow(f"{name} received again while stopping ({self.reason}): stopped at once", 128 + signum)
        raise self.at_once

    def _time_is_up(self) -> None:
        minutes = (time.monotonic() - self._started) / 60.0
        self.request(f"--exit-duration-in-mins {self._deadline_s / 60.0:g} reached ({minutes:.1f} minutes)")
        logger.warning("%s: stopping at the next safe point", self.reason)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


__all__ = ["GracefulStop", "StopNow", "StoppedOnRequest", "signal_name"]
