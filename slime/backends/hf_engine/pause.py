"""`/pause_generation`, `/continue_generation` and what a weight update or a flush does to a paused engine, as
SGLang 0.5.23 does them.

Every mode holds new `/generate` requests until `/continue_generation` (`HoldNewRequests`); `abort` aborts the
scheduler's requests, `retract` stops the scheduler and sends its rows back to the waiting queue (KV freed, tokens
kept), `in_place` stops it with rows and KV kept. While paused a flush ignores the waiting queue, so it succeeds
under `retract` and fails under `in_place` while rows are held (`FLUSH_FAILED`; the weights still load). The
functions taking a scheduler run on its thread, between two steps.
"""

from __future__ import annotations

import asyncio
from typing import Callable

MODES = ("abort", "retract", "in_place")

# scheduler_components/weight_updater.py (SGLang 0.5.23): an update's flush refused while requests run or wait
FLUSH_FAILED = ("Weights were updated, but the cache was not flushed because requests are still running or queued. "
                "Retract or finish them, then call /flush_cache.")


def pause(sched, mode: str) -> int:
    """The scheduler's part of `/pause_generation {mode}`; returns the requests it aborted or retracted."""
    if mode == "abort":  # SGLang's tokenizer manager aborts everything; its scheduler keeps running
        return sched.abort(None)  # SGLang's FINISH_ABORT, as for /abort_request
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
    sched.set_paused(True)
    return sched.retract() if mode == "retract" else 0


def resume(sched) -> None:
    """The scheduler's part of `/continue_generation`: it steps again (retracted requests are prefilled again)."""
    sched.set_paused(False)


def is_idle(sched) -> bool:
    """SGLang's `is_fully_idle(ignore_waiting=<paused>)`: what a flush needs."""
    return not sched.running and (sched.paused or not sched.waiting)


def flush_if_idle(sched) -> bool:
    """SGLang's `Scheduler.flush_cache`: empty the prefix cache when idle (as above); True if flushed."""
    if not is_idle(sched):
        return False
    sched.prefix_cache.clear()
    return True


def update(sched, load: Callable[[], None], version: str, flush_cache: bool) -> tuple[int, int, bool]:
    """A weight update between two steps: `load()` the weights, record `version`, flush if asked. Returns (running
    requests, requests in flight, flushed). Paused: requests stay as the pause left them and the flush is SGLang's;
    not paused: running requests are retracted and recomputed on the new weights (SGLang would wait for them)."""
    held = sched.paused
    n_running = sched.num_running if held else sched.retract()
    in_flight = sched.num_running + sched.num_waiting
    load()
    sched.set_weight_version(version)
    if not flush_cache:  # KV the old weights computed stays, apart by extra_key (prefix_cache.py)
        return n_running, in_flight, True
    if held:
        return n_running, in_flight, flush_if_idle(sched)
    sched.prefix_cache.clear()
    return n_running, in_flight, True


class HoldNewRequests:
    """The tokenizer manager's `is_pause` condition: from `/pause_generation` (any mode) to `/continue_generation`,
    a new `/generate` request waits here before the scheduler sees it."""

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()

    @property
    def holding(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        await self._open.wait()
