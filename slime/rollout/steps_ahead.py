"""One-step-off (train_async.py, `--rollout-mode chunked|pool`): APRIL steps ahead of the trainer, step j once the
engines are within `--max-async-lag` of the version that trains it; updates pause it per `--pause-mode` (a custom
rollout function's step is waited for instead)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from slime.rollout.base_types import RolloutOutput
from slime.rollout.buffer import call_maybe_remote
from slime.rollout.step_record import RolloutEngineFaultError, RolloutError
from slime.rollout.version_gate import VersionGate

logger = logging.getLogger(__name__)

TAKE_POLL_S = 5.0


class StepsAhead:
    """Steps of the run's `rollout` ahead of the trainer (`custom_step`: a custom function's, on a thread)."""

    def __init__(self, rollout, first_rollout_id: int, num_rollout: int, version_offset: int, max_lag: int,
                 custom_step: Callable[[int], RolloutOutput] | None = None):
        self.rollout, self.buffer, self.custom_step = rollout, rollout.buffer, custom_step
        self.step_lock = asyncio.Lock()  # held while a custom (not pausable) step runs
        self.gate: VersionGate = rollout.run_ahead(self, pausable=custom_step is None)
        self.max_lag = int(max_lag)  # --max-async-lag
        self.offset = int(version_offset)
        self.num_rollout = int(num_rollout)
        self.rpc_timeout = rollout.config.rpc_timeout
        self.next_batch = int(first_rollout_id)  # next batch take() hands out
        self.next_step = int(first_rollout_id)  # next step to produce
        self.outputs: dict[int, RolloutOutput] = {}
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        self.running_step: int | None = None
        self._halt: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.max_queue = 0

    def train_version(self, batch: int) -> int:
        return batch + self.offset

    def _admitted(self, j: int) -> bool:
        return self.gate.version >= self.train_version(j) - self.max_lag

    # ---- production ------------------------------------------------------------------------
    async def resume(self) -> None:
        self._halt = asyncio.Event()
        self._task = asyncio.ensure_future(self._produce(self._halt))

    async def rebalance(self) -> None:
        self.changed.set()  # a new version may admit the next step

    async def _produce(self, halt: asyncio.Event) -> None:
        try:
            while self.next_step < self.num_rollout and not halt.is_set():
                j = self.next_step
                while not self._admitted(j) and not halt.is_set():
                    self.changed.clear()
                    await _wait_either(self.changed, halt)
                if halt.is_set():
                    return
                out = await self._run_step(j, halt)
                if out.groups or not out.metrics.get("rollout/halted"):
                    self.outputs[j] = out
                    self.next_step = j + 1
                    self.max_queue = max(self.max_queue, len(self.outputs))
                    self.changed.set()
        except Exception as e:  # noqa: BLE001 - handed to the trainer's take()
            logger.error("rollout step %d failed: %s", self.next_step, e)
            self.error = e
            self.changed.set()

    async def _run_step(self, j: int, halt: asyncio.Event) -> RolloutOutput:
        self.gate.set_train_version(self.train_version(j))
        self.running_step = j
        try:
            if self.custom_step is None:
                return await self.rollout.step(j, halt=halt)
            async with self.step_lock:
                return await asyncio.to_thread(self.custom_step, j)
        finally:
            self.running_step = None

    async def quiesce(self) -> None:
        """Halt the running step and move finished steps not yet taken to the buffer's ready list."""
        if self._task is not None:
            self._halt.set()
            await self._task
            self._task = None
        for j in sorted(self.outputs):
            groups = self.outputs[j].groups
            if groups:  # `finished` in the ledger (the step's commit marked them)
                await call_maybe_remote(self.buffer, "hold_ready", groups, timeout=self.rpc_timeout)
        self.outputs.clear()
        self.next_step = self.next_batch
        self.changed.set()

    # ---- the trainer's side -------------------------------------------------------------------
    async def take(self, rollout_id: int, timeout: float) -> RolloutOutput:
        if rollout_id != self.next_batch:
            raise ValueError(f"asked for batch {rollout_id}, the next one is {self.next_batch}")
        t0 = time.monotonic()
        while rollout_id not in self.outputs:
            if isinstance(self.error, RolloutEngineFaultError):
                raise self.error  # it names the engine (train_async.py stops on it with one line)
            if self.error is not None:
                raise RolloutError(f"rollout step {self.next_step} failed: {self.error}") from self.error
            if self._task is None or self._task.done():
                raise RolloutError(f"batch {rollout_id} was asked for but no rollout step is running")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), TAKE_POLL_S)
            except TimeoutError:
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"rollout step {rollout_id} not done after {timeout:.0f}s") from None
        out = self.outputs.pop(rollout_id)
        self.next_batch += 1
        self.changed.set()
        waited = time.monotonic() - t0
        out.metrics.update({
            "rollout/wait_s": waited,
            "async/queue_groups": float(sum(len(o.groups) for o in self.outputs.values())),
            "async/queue_steps_max": float(self.max_queue),
        })
        self.max_queue = len(self.outputs)
        return out

    def stats(self) -> dict[str, Any]:
        return {"running_step": self.running_step, "queued_steps": sorted(self.outputs)}


async def _wait_either(a: asyncio.Event, b: asyncio.Event) -> None:
    ta, tb = asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())
    try:
        await asyncio.wait({ta, tb}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ta.cancel()
        tb.cancel()


__all__ = ["StepsAhead"]
