"""Who holds the shared devices in each phase of a training step.

Disaggregated (`Phases`): nothing moves. Colocated (`ColocatedPhases`, `--colocate`), as slime does:

    rollout       engines hold weights + KV cache; the trainer is offloaded (--offload)
    train         engines release weights, KV cache and CUDA graphs; the trainer onloads and trains
    weight_sync   engines resume their weights; the trainer hands them the new ones (tensor sync);
                  then the trainer offloads and the engines resume their KV cache and CUDA graphs

`metrics()` returns each phase's seconds (`perf/*`) and, colocated, what each hand-over cost (`colocate/*`)."""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Callable

logger = logging.getLogger(__name__)

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # SGLang's memory tags
ENGINE_INFO_TIMEOUT_S = 10.0


class Phases:
    """Disaggregated: every phase runs where it is."""

    def __init__(self):
        self._metrics: dict[str, float] = {}

    def _add(self, key: str, value: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + value

    @contextmanager
    def _body(self, name: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self._add(f"perf/{name}_s", time.monotonic() - t0)

    def rollout(self):
        return self._body("rollout")

    def train(self):
        return self._body("train")

    def weight_sync(self):
        return self._body("weight_push")

    def metrics(self) -> dict[str, float]:
        out, self._metrics = self._metrics, {}
        return out


class ColocatedPhases(Phases):
    def __init__(self, trainer, engines, offload: bool, engine_memory: Callable[[], dict | None] | None = None):
        """`trainer`: a RayTrainGroup (or None: --debug-rollout-only); `engines`: an EngineGroup (or None:
        --debug-train-only); `engine_memory`: what the engines hold now (`engine_memory`), None where unknown."""
        super().__init__()
        self.trainer = trainer
        self.engines = engines
        self.offload = offload and trainer is not None
        self.trainer_on_device = trainer is not None  # trainers start on their devices
        self.released: set[str] = set()
        self._engine_memory = engine_memory if engines is not None else None

    def _timed(self, key: str, fn, *args):
        t0 = time.monotonic()
        out = fn(*args)
        self._add(f"colocate/{key}_s", time.monotonic() - t0)
        return out

    def _offload_trainer(self) -> None:
        if self.offload and self.trainer_on_device:
            out = self._timed("trainer_offload", self.trainer.offload)
            self._add("colocate/trainer_offload_bytes", float(out.get("offload_bytes", 0.0)))
            if out.get("reserved_before"):  # a GPU: what the caching allocator gave back to the device
                self._add("colocate/trainer_device_freed_bytes", out["reserved_before"] - out["reserved_after"])
            self.trainer_on_device = False

    def _onload_trainer(self) -> None:
        if self.offload and not self.trainer_on_device:
            out = self._timed("trainer_onload", self.trainer.onload)
            self._add("colocate/trainer_onload_bytes", float((out or {}).get("onload_bytes", 0.0)))
            self.trainer_on_device = True

    def _engines_call(self, key: str, fn, tags: list[str]) -> None:
        """Release or resume `tags` on every engine: seconds, and the memory the engines held before and after."""
        before = self._memory()
        self._timed(key, fn, tags)
        after = self._memory()
        if before is None or after is None:
            return
        sign = 1 if key == "engine_release" else -1  # released: held before - after; resumed: after - before
        self._add(f"colocate/{key}_bytes", sign * (before["held"] - after["held"]))
        if "device_free" in before and "device_free" in after and key == "engine_release":
            self._add("colocate/engine_device_freed_bytes", after["device_free"] - before["device_free"])

    def _memory(self) -> dict | None:
        if self._engine_memory is None:
            return None
        try:
            return self._engine_memory()
        except Exception as e:  # a metric: never stop training for it
            logger.warning("the engines' memory is not measured (%s): colocate/engine_*_bytes left out", e)
            self._engine_memory = None
            return None

    def _release(self, tags: list[str]) -> None:
        tags = [t for t in tags if t not in self.released]
        if self.engines is not None and tags:
            self._engines_call("engine_release", self.engines.release_memory_occupation, tags)
        self.released.update(tags)

    def _resume(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self.released]
        if self.engines is not None and tags:
            self._engines_call("engine_resume", self.engines.resume_memory_occupation, tags)
        self.released.difference_update(tags)

    @contextmanager
    def rollout(self):
        self._offload_trainer()  # the first step: the trainer comes from its set-up on the device
        self._resume([WEIGHTS, KV_CACHE, CUDA_GRAPH])
        with self._body("rollout"):
            yield

    @contextmanager
    def train(self):
        self._release([WEIGHTS, KV_CACHE, CUDA_GRAPH])
        self._onload_trainer()
        with self._body("train"):
            yield

    @contextmanager
    def weight_sync(self):
        self._resume([WEIGHTS])
        with self._body("weight_push"):
            yield
        self._offload_trainer()
        self._resume([KV_CACHE, CUDA_GRAPH])


def engine_memory(engines) -> dict | None:
    """What the engines hold by their own count (GPU: and free bytes); None when one does not say."""
    from slime.backends.sglang_utils.http_client import get_json

    held = free = 0
    on_gpu = True
    for url in engines.engine_urls:
        info = get_json(url.rstrip("/") + "/get_server_info", timeout=ENGINE_INFO_TIMEOUT_S)
        states = info.get("internal_states") if isinstance(info, dict) else None
        mem = states[0].get("memory") if isinstance(states, list) and states and isinstance(states[0], dict) else None
        if not isinstance(mem, dict) or "weight_bytes" not in mem:
            return None
        held += mem["weight_bytes"] + mem.get("kv_cache_bytes", 0)
        on_gpu = on_gpu and "device_free_bytes" in mem
        free += mem.get("device_free_bytes", 0)
    return {"held": held, **({"device_free": free} if on_gpu else {})}


def device_phases(args, trainer, engines) -> Phases:
    """The phases of `--colocate` (or of a disaggregated run)."""
    if not args.colocate:
        return Phases()
    logger.info("colocated: engines release their memory while the trainer trains%s",
                "; the trainer is offloaded between training phases" if args.offload else "")
    return ColocatedPhases(trainer, engines, args.offload, lambda: engine_memory(engines))
