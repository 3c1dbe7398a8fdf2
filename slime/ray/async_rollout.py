"""AsyncRollout: train_async.py's rollout side, the run's `Rollout` running ahead of the trainer on its own thread.

    rollout = AsyncRollout(args, rollout_manager, first_rollout_id).start()
    batch = rollout.next_batch(rollout_id)                     # waits only if the rollout is behind
    with rollout.updating_weights(version) as flush: push()    # in flight, per --pause-mode (Rollout's protocol)
    with rollout.paused("eval"): ...                           # nothing of ours on the engines meanwhile
    with rollout.quiesced(): save_checkpoint(...)              # everything in flight parked in the buffer first
    rollout.stop()                                             # parks everything, closes the loop

The production itself is steps_ahead.py (`--rollout-mode chunked|pool`) or stream.py (`stream`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any

from slime.rollout.base_types import RolloutOutput
from slime.rollout.sglang_rollout import SESSION_EXTRA_CONNECTIONS, generate_rollout
from slime.rollout.steps_ahead import StepsAhead
from slime.rollout.stream import StreamRollout

logger = logging.getLogger(__name__)

CALL_SLACK_S = 60.0


class AsyncRollout:
    def __init__(self, args, manager, first_rollout_id: int):
        if manager.engines is None:
            raise ValueError("train_async.py needs rollout engines (no --debug-train-only)")
        self.args, self.manager, self.rollout = args, manager, manager.rollout
        self.first_rollout_id = int(first_rollout_id)
        # the trainer trains batch j at policy version j + offset (one version per step since the run began)
        self.offset = int(manager.policy_version) - self.first_rollout_id
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="async-rollout", daemon=True)
        self.producer: StepsAhead | StreamRollout | None = None
        self._stopped = False

    @property
    def gate(self):
        return self.rollout.gate

    def _call(self, coro, timeout: float) -> Any:
        """Run `coro` on the rollout's loop and wait for its result (with a deadline)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout=timeout)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"async rollout: {getattr(coro, '__name__', coro)} did not finish in {timeout:.0f}s") from None

    @property
    def _drain_timeout(self) -> float:
        return self.args.rollout_abort_timeout + CALL_SLACK_S

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> "AsyncRollout":
        self.thread.start()
        self._call(self._start(), self._drain_timeout)
        logger.info("async rollout (%s) started at batch %d, policy version %d, max lag %d",
                    "stream" if self.args.rollout_mode == "stream" else f"one-step-off, {self.args.rollout_mode}",
                    self.first_rollout_id, self.manager.policy_version, self.args.max_async_lag)
        return self

    async def _start(self) -> None:
        import aiohttp

        a, m = self.args, self.manager
        limit = max(a.rollout_pool_size, a.sglang_server_concurrency * a.num_engines) + SESSION_EXTRA_CONNECTIONS
        self.rollout.link.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit))
        ahead = (self.rollout, self.first_rollout_id, m.num_rollout, self.offset, a.max_async_lag)
        if a.rollout_mode == "stream":
            self.producer = StreamRollout(*ahead)
        else:  # the built-in step honours the gate; a custom rollout function's steps are waited for instead
            custom = None if m.rollout_fn is generate_rollout else (lambda j: m.call_rollout_fn(j, m.rollout.context()))
            self.producer = StepsAhead(*ahead, custom_step=custom)
        await self.producer.resume()

    def stop(self) -> None:
        """Park everything in flight in the buffer, close the session and the loop. Idempotent."""
        if self._stopped or not self.thread.is_alive():
            self._stopped = True
            return
        self._stopped = True
        try:
            if self.producer is not None:
                self._call(self.producer.quiesce(), self._drain_timeout + self.args.reward_timeout)
        finally:
            if self.rollout.link.session is not None:
                with contextlib.suppress(Exception):
                    self._call(self.rollout.link.session.close(), 30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)

    # ---- the training loop's calls --------------------------------------------------------------
    def next_batch(self, rollout_id: int) -> RolloutOutput | None:
        """Batch `rollout_id`: its groups (finished, rewarded, accepted) and rollout metrics. None: the run's stop
        request (the manager's `halt`) came first (`stop()` then parks everything in flight)."""
        timeout = self.args.rollout_request_timeout
        out = self._call(self._take_unless_stopped(rollout_id, timeout), timeout + CALL_SLACK_S)
        if out is None:
            return None
        g = self.gate.stats()
        out.metrics.update({"async/gate_pauses": g["pauses"], "async/gate_held_s": g["held_s"],
                            "async/gate_drain_s": g["drain_s"], "async/engine_version": float(self.gate.version),
                            "async/update_pause_s": self.rollout.update_pause_s})
        out.metrics.update({f"async/buffer_{k}": float(v) for k, v in self.manager.buffer_sizes().items()})
        return self.manager.finish_batch(rollout_id, out)

    async def _take_unless_stopped(self, rollout_id: int, timeout: float) -> RolloutOutput | None:
        stop = self.manager.halt
        if stop is None:
            return await self.producer.take(rollout_id, timeout)
        if stop.is_set():
            return None
        take, stopped = asyncio.ensure_future(self.producer.take(rollout_id, timeout)), asyncio.ensure_future(stop.wait())
        await asyncio.wait({take, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not take.done():
            take.cancel()  # (a cancelled take hands back the groups it held)
            await asyncio.wait({take})
            return None
        return take.result()

    @contextlib.contextmanager
    def updating_weights(self, new_version: int):
        """The driver pushes `new_version` inside, given `flush_cache`, while the rollout runs: the Rollout's
        `updating_weights` (--pause-mode), entered and left on the rollout's loop."""
        update = self.rollout.updating_weights(int(new_version))
        flush = self._call(update.__aenter__(), self._drain_timeout + self.args.rollout_request_timeout)
        try:
            yield flush
        except BaseException as e:
            self._call(update.__aexit__(type(e), e, e.__traceback__), self._drain_timeout)
            raise
        self._call(update.__aexit__(None, None, None), self._drain_timeout)

    @contextlib.contextmanager
    def paused(self, reason: str):
        """Nothing of ours runs on the engines inside (e.g. an eval shares them)."""
        self._call(self.rollout.hold(reason), self._drain_timeout + self.args.rollout_request_timeout)
        try:
            yield
        finally:
            self._call(self.rollout.release(reason), self._drain_timeout)

    @contextlib.contextmanager
    def quiesced(self, resume: bool = True):
        """Everything in flight parked (and every finished group not yet trained kept ready) in the buffer
        inside, so a checkpoint holds it all; production resumes afterwards unless `resume` is False."""
        self._call(self.producer.quiesce(), self._drain_timeout + self.args.reward_timeout + CALL_SLACK_S)
        try:
            yield
        finally:
            if resume:
                self._call(self.producer.resume(), self._drain_timeout)


__all__ = ["AsyncRollout"]
