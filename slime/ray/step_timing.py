"""The `perf/` timings of each training step: its wall time, how long the trainer was busy and how long the
engines were idle (the embedded engine's counter; absent with SGLang)."""

from __future__ import annotations

import logging
import time

from slime.backends.sglang_utils.engine_api import engine_idle_seconds

logger = logging.getLogger("train")


class StepTiming:
    def __init__(self, engines):
        """`engines`: the run's EngineGroup (None: --debug-train-only)."""
        self.engines = engines
        self._idle_counter = engines is not None  # False once an engine has no idle counter
        self.trainer_busy = 0.0  # seconds of this step's training calls and weight pushes (the loop adds them)
        self._start, self._idle_start = time.monotonic(), None

    def restart(self) -> None:
        """The clock of the next step starts now."""
        self._start, self._idle_start, self.trainer_busy = time.monotonic(), self._engine_idle(), 0.0

    def metrics(self) -> dict[str, float]:
        """This step's timings; the next step's clock starts."""
        out = {"perf/step_time_s": time.monotonic() - self._start, "perf/trainer_busy_s": self.trainer_busy}
        idle = self._engine_idle()
        if idle is not None and self._idle_start is not None:
            out["perf/engine_idle_s"] = idle - self._idle_start
        self._start, self._idle_start, self.trainer_busy = time.monotonic(), idle, 0.0
        return out

    def _engine_idle(self) -> float | None:
        if not self._idle_counter:
            return None
        try:
            idle = engine_idle_seconds(self.engines.engine_urls)  # the engines this run launched (no router)
        except Exception as e:  # a metric: never stop training for it
            logger.warning("engine idle time not measured (%s)", e)
            idle = None
        if idle is None:
            self._idle_counter = False
        return idle


__all__ = ["StepTiming"]
