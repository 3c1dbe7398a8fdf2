"""Run a blocking check off the event loop in a daemon thread, under a deadline: the loop keeps serving, and a
check that hangs (it cannot be killed) never blocks the caller past the deadline nor interpreter exit."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


async def run_in_daemon_thread(fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                               name: str | None = None) -> Any:
    """`fn(*args)` in a fresh daemon thread; TimeoutError after `timeout` seconds (None: no limit)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():  # the caller gave up (timeout or cancel)
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while we worked: nobody is waiting
            pass

    threading.Thread(target=target, name=name or f"rm-check-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await asyncio.wait_for(future, timeout)
