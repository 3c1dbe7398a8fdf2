"""Who holds the shared devices in each phase of a training step.

Disaggregated (`Phases`): trainers and engines have devices of their own; nothing moves. Colocated
(`ColocatedPhases`, `--colocate`): every device holds a trainer rank and (a share of) an engine, and the
step hands the memory back and forth, as slime does:

    rollout       engines hold weights + KV cache; the trainer is offloaded (--offload)
    train         engines release weights, KV cache and CUDA graphs; the trainer onloads and trains
    weight_sync   engines resume their weights; the trainer hands them the new ones (tensor sync);
                  then the trainer offloads and the engines resume their KV cache and CUDA graphs
                  (eval and the next rollout find them whole)

train.py wraps each phase in its context manager and reads the same either way. Each phase's cost goes
to `metrics()` (`colocate/*`: seconds spent releasing, resuming, offloading, onloading; bytes moved).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's memory tags


class Phases:
    """Disaggregated: every phase runs where it is."""

    @contextmanager
    def rollout(self):
        yield

    @contextmanager
    def train(self):
        yield

    @contextmanager
    def weight_sync(self):
        yield

    def metrics(self) -> dict[str, float]:
        return {}


class ColocatedPhases(Phases):
    def __init__(self, trainer, engines, offload: bool):
        """`trainer`: a RayTrainGroup (or None: --debug-rollout-only); `engines`: an EngineGroup (or None:
        --debug-train-only)."""
        self.trainer = trainer
        self.engines = engines
        self.offload = offload and trainer is not None
        self.trainer_on_device = trainer is not None  # trainers start on their devices
        self.released: set[str] = set()
        self._metrics: dict[str, float] = {}

    def _timed(self, key: str, fn, *args):
        t0 = time.monotonic()
        out = fn(*args)
        self._metrics[f"colocate/{key}_s"] = self._metrics.get(f"colocate/{key}_s", 0.0) + time.monotonic() - t0
        return out

    def _offload_trainer(self) -> None:
        if self.offload and self.trainer_on_device:
            out = self._timed("trainer_offload", self.trainer.offload)
            self._metrics["colocate/trainer_offload_bytes"] = float(out.get("offload_bytes", 0.0))
            self.trainer_on_device = False

    def _onload_trainer(self) -> None:
        if self.offload and not self.trainer_on_device:
            self._timed("trainer_onload", self.trainer.onload)
            self.trainer_on_device = True

    def _release(self, tags: list[str]) -> None:
        tags = [t for t in tags if t not in self.released]
        if self.engines is not None and tags:
            self._timed("engine_release", self.engines.release_memory_occupation, tags)
        self.released.update(tags)

    def _resume(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self.released]
        if self.engines is not None and tags:
            self._timed("engine_resume", self.engines.resume_memory_occupation, tags)
        self.released.difference_update(tags)

    @contextmanager
    def rollout(self):
        self._offload_trainer()  # the first step: the trainer comes from its set-up on the device
        self._resume([WEIGHTS, KV_CACHE, CUDA_GRAPH])
        yield

    @contextmanager
    def train(self):
        self._release([WEIGHTS, KV_CACHE, CUDA_GRAPH])
        self._onload_trainer()
        yield

    @contextmanager
    def weight_sync(self):
        self._resume([WEIGHTS])
        yield
        self._offload_trainer()
        self._resume([KV_CACHE, CUDA_GRAPH])

    def metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out


def device_phases(args, trainer, engines) -> Phases:
    """The phases of `--colocate` (or of a disaggregated run)."""
    if not args.colocate:
        return Phases()
    logger.info("colocated: engines release their memory while the trainer trains%s",
                "; the trainer is offloaded between training phases" if args.offload else "")
    return ColocatedPhases(trainer, engines, args.offload)
