"""AsyncRollout: train_async.py's rollout side, running ahead of the trainer on its own thread.

The rollout runs on a background thread with its own asyncio loop, one aiohttp session to the router
and one `VersionGate`; the driver thread (the training loop) calls in with blocking methods:

    rollout = AsyncRollout(args, rollout_manager, first_rollout_id).start()
    batch = rollout.next_batch(rollout_id)              # waits only if the rollout is behind
    with rollout.updating_weights(new_version): push()  # in flight: pause at the gate, push, resume
    with rollout.paused("eval"): ...                    # nothing of ours on the engines meanwhile
    with rollout.quiesced(): save_checkpoint(...)       # everything in flight parked in the buffer first
    rollout.stop()                                      # parks everything, closes the loop

The production itself is `slime/rollout/steps_ahead.py` (one-step-off APRIL steps, `--rollout-mode
chunked|pool`) or `slime/rollout/stream.py` (`--rollout-mode stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from slime.rollout.base_types import RolloutContext, RolloutOutput
from slime.rollout.sglang_rollout import StepHooks, generate_rollout, generate_rollout_async, run_rollout_step
from slime.rollout.steps_ahead import StepsAhead
from slime.rollout.stream import StreamConfig, StreamRollout
from slime.rollout.version_gate import VersionGate

logger = logging.getLogger(__name__)

CALL_SLACK_S = 60.0
SESSION_EXTRA_CONNECTIONS = 32


class AsyncRollout:
    def __init__(self, args, manager, first_rollout_id: int):
        if manager.engines is None:
            raise ValueError("train_async.py needs rollout engines (no --debug-train-only)")
        self.args = args
        self.manager = manager
        self.first_rollout_id = int(first_rollout_id)
        # the trainer trains batch j at policy version j + offset (one version per step since the run began)
        self.offset = int(manager.policy_version) - self.first_rollout_id
        # the built-in step honours the gate; a custom rollout function's steps are waited for instead
        # (stream mode always runs the built-in one: slime/arguments/partial_rollout.py)
        self.pausable = manager.rollout_fn is generate_rollout
        # a custom rollout function's step is waited for before an update: nothing of ours is then in flight
        self.pause_mode = args.pause_mode if self.pausable else "abort"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="async-rollout", daemon=True)
        self.gate: VersionGate | None = None
        self.producer: StepsAhead | StreamRollout | None = None
        self.session = None
        self._stopped = False
        self.update_pause_s = 0.0

    # ---- plumbing -----------------------------------------------------------------------
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

    def _make_ctx(self) -> RolloutContext:
        return self.manager.context(policy_version=self.gate.version)

    def _hooks(self, halt: asyncio.Event, on_io=None) -> StepHooks:
        """The built-in step's async hooks: this loop's session, the gate, the halt event."""
        return StepHooks(session=self.session, gate=self.gate, halt=halt, on_io=on_io)

    async def _builtin_step(self, rollout_id: int, halt: asyncio.Event) -> RolloutOutput:
        return await generate_rollout_async(self.args, rollout_id, self._make_ctx(), hooks=self._hooks(halt))

    def _custom_step(self, rollout_id: int) -> RolloutOutput:
        return self.manager.call_rollout_fn(rollout_id, self._make_ctx())

    async def _run_segment(self, rollout_id: int, supply, placement, halt: asyncio.Event, on_io) -> RolloutOutput:
        return await run_rollout_step(self.args, rollout_id, self._make_ctx(), supply, placement,
                                      self._hooks(halt, on_io))

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> "AsyncRollout":
        self.thread.start()
        self._call(self._start(), self._drain_timeout)
        logger.info("async rollout (%s) started at batch %d, policy version %d, max lag %d, updates %s",
                    "stream" if self.args.rollout_mode == "stream" else f"one-step-off, {self.args.rollout_mode}",
                    self.first_rollout_id, self.manager.policy_version, self.args.max_async_lag,
                    f"with --pause-mode {self.pause_mode}")
        return self

    async def _start(self) -> None:
        import aiohttp

        a = self.args
        limit = max(a.rollout_pool_size, a.sglang_server_concurrency * a.num_engines) + SESSION_EXTRA_CONNECTIONS
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit))
        version = int(self.manager.policy_version)
        self.gate = VersionGate(version, train_version=version)
        if self.pause_mode == "in_place" and self.manager.engines.backend == "sglang":
            self.gate.span_lag = 1  # SGLang appends the token in flight at an in-place pause after the update
        m = self.manager
        if a.rollout_mode == "stream":
            self.producer = StreamRollout(StreamConfig.from_args(a, m.cap), self._run_segment, self.gate, m.buffer, m.engines,
                                          self.first_rollout_id, m.num_rollout, self.offset, session=self.session)
        elif self.pausable:
            self.producer = StepsAhead(a, self.gate, m.buffer, self.first_rollout_id, m.num_rollout, self.offset,
                                       builtin_step=self._builtin_step)
        else:
            self.producer = StepsAhead(a, self.gate, m.buffer, self.first_rollout_id, m.num_rollout, self.offset,
                                       custom_step=self._custom_step)
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
            if self.session is not None:
                with contextlib.suppress(Exception):
                    self._call(self.session.close(), 30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)

    # ---- the training loop's calls --------------------------------------------------------------
    def next_batch(self, rollout_id: int) -> RolloutOutput:
        """Batch `rollout_id`: its groups (finished, rewarded, accepted) and rollout metrics."""
        timeout = self.args.rollout_request_timeout
        out = self._call(self.producer.take(rollout_id, timeout), timeout + CALL_SLACK_S)
        out.metrics.update(self._gate_metrics())
        out.metrics.update({f"async/buffer_{k}": float(v) for k, v in self.manager.buffer_sizes().items()})
        return self.manager.finish_batch(rollout_id, out)

    def _gate_metrics(self) -> dict[str, float]:
        g = self.gate.stats()
        return {"async/gate_pauses": g["pauses"],
                "async/gate_held_s": g["held_s"], "async/gate_drain_s": g["drain_s"],
                "async/engine_version": float(self.gate.version), "async/update_pause_s": self.update_pause_s}

    @contextlib.contextmanager
    def updating_weights(self, new_version: int):
        """The driver pushes new weights inside, as `new_version`, while the rollout runs (`--pause-mode`).

        abort: every request of ours is aborted and waits at the gate (a custom rollout function's step is
        waited for instead), then they resume from their tokens. retract / in_place: no new request passes the
        gate, the engines are paused in that mode (SGLang's /pause_generation: they keep our requests) and go on
        after the push, each token labelled with the version that sampled it; before they go on, the requests
        that may now exceed --max-staleness (restart policy) are aborted by rid, so they restart when they resume."""
        t0 = time.monotonic()
        if self.pause_mode != "abort":
            self._call(self._pause_engines(int(new_version)), self._drain_timeout)
            try:
                yield
            finally:
                self._call(self._continue_engines(), self._drain_timeout)
                self.update_pause_s = time.monotonic() - t0
            return
        self._call(self._before_update(), self._drain_timeout + self.args.rollout_request_timeout)
        try:
            yield
        finally:
            self._call(self._after_update(int(new_version)), self._drain_timeout)
            self.update_pause_s = time.monotonic() - t0

    async def _pause_engines(self, version: int) -> None:
        self.gate.begin_update(version)  # replies may carry `version` from now on
        await self.gate.hold("update", self.manager.engines, self.session, drain=False)  # nothing new is sent
        await asyncio.to_thread(self.manager.engines.pause, self.pause_mode)

    async def _continue_engines(self) -> None:
        self.gate.end_update()
        await self.producer.rebalance()  # may add a "lag" hold while the gate is still closed
        floor = self.manager.cap.restart_floor(self.gate.train_version)
        if floor is not None:
            stale = self.gate.stale_requests(floor)
            await self.gate.abort_requests(stale, self.manager.engines, self.session)
        await asyncio.to_thread(self.manager.engines.continue_generation)
        self.gate.release("update")

    async def _before_update(self) -> None:
        await self._pause("update")

    async def _after_update(self, version: int) -> None:
        self.gate.set_version(version)
        await self._unpause("update")  # backpressure is decided for the new version before the gate reopens

    @contextlib.contextmanager
    def paused(self, reason: str):
        """Nothing of ours runs on the engines inside (e.g. an eval shares them)."""
        self._call(self._pause(reason), self._drain_timeout + self.args.rollout_request_timeout)
        try:
            yield
        finally:
            self._call(self._unpause(reason), self._drain_timeout)

    async def _pause(self, reason: str) -> None:
        if not self.pausable:  # a custom step cannot be paused: wait until it ends (nothing passes the gate)
            await self.producer.step_lock.acquire()
        await self.gate.hold(reason, self.manager.engines, self.session, timeout=self.args.rollout_abort_timeout)

    async def _unpause(self, reason: str) -> None:
        await self.producer.rebalance()  # may add a "lag" hold while the gate is still closed
        self.gate.release(reason)
        if not self.pausable:
            self.producer.step_lock.release()

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
