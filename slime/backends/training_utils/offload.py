"""`--offload`: the trainer's state leaves the device between training phases and comes back. It works on the
distinct storages behind every parameter, gradient and optimizer tensor: their bytes go to a host buffer and the
storage is resized to 0, which frees the memory while every tensor, view and reference stays valid."""

from __future__ import annotations

import gc
import logging
from contextlib import contextmanager
from typing import Iterable

import torch

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (FSDP2 parameters, gradients and optimizer state)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    """Every tensor a torch optimizer holds: its parameters, their gradients and its per-parameter state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
            if p.grad is not None:
                yield p.grad
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                yield v


def module_tensors(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """A model's parameters and their gradients (`.grad`, and Megatron's `.main_grad` buffer views)."""
    for p in module.parameters():
        yield p
        if p.grad is not None:
            yield p.grad
        main_grad = p.__dict__.get("main_grad")
        if isinstance(main_grad, torch.Tensor):
            yield main_grad


class DeviceOffloader:
    def __init__(self, name: str = "trainer"):
        self.name = name
        self._entries: list[tuple[torch.UntypedStorage, int, torch.Tensor]] = []  # storage, bytes, host copy
        self._pinned: dict[tuple[int, int], torch.Tensor] = {}  # reused pinned buffers (GPU)
        self.offloaded = False

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> dict[str, float]:
        if self.offloaded:
            raise RuntimeError(f"{self.name}: offload called twice without an onload in between")
        seen: dict[tuple[str, int], torch.UntypedStorage] = {}
        for t in tensors:
            t = _local(t)
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            seen.setdefault((str(storage.device), storage.data_ptr()), storage)
        cuda = any(s.device.type == "cuda" for s in seen.values())
        before = _memory()
        if cuda:
            torch.cuda.synchronize()
        moved = 0
        for i, ((dev, ptr), storage) in enumerate(seen.items()):
            n = storage.nbytes()
            if not storage.resizable():
                raise RuntimeError(f"{self.name}: a storage of {n} bytes on {dev} cannot be resized (memory-mapped?); "
                                   "it cannot be offloaded")
            host = self._host_buffer(i, n, storage.device.type == "cuda")
            host.copy_(_bytes(storage, n), non_blocking=False)
            storage.resize_(0)
            self._entries.append((storage, n, host))
            moved += n
        if cuda:  # give the freed blocks back to the driver (garbage first: a cycle may still hold device tensors)
            gc.collect()
            torch.cuda.empty_cache()
        self.offloaded = True
        after = _memory()
        logger.info("%s offloaded: %d storages, %.1f MB (device allocated %.1f -> %.1f MB)", self.name, len(seen),
                    moved / 2**20, before["allocated"] / 2**20, after["allocated"] / 2**20)
        return {"offload_bytes": float(moved), "offload_storages": float(len(seen)),
                "allocated_before": before["allocated"], "allocated_after": after["allocated"],
                "reserved_before": before["reserved"], "reserved_after": after["reserved"]}

    @torch.no_grad()
    def onload(self) -> dict[str, float]:
        if not self.offloaded:
            raise RuntimeError(f"{self.name}: onload called without an offload")
        moved = 0
        for storage, n, host in self._entries:
            storage.resize_(n)
            _bytes(storage, n).copy_(host, non_blocking=host.is_pinned())
            moved += n
        if any(s.device.type == "cuda" for s, _, _ in self._entries):
            torch.cuda.synchronize()
        self._entries.clear()
        self.offloaded = False
        return {"onload_bytes": float(moved)}

    def _host_buffer(self, i: int, nbytes: int, pin: bool) -> torch.Tensor:
        if not pin:  # CPU: a fresh buffer, dropped after the onload
            return torch.empty(nbytes, dtype=torch.uint8)
        key = (i, nbytes)
        buf = self._pinned.get(key)
        if buf is None:
            buf = self._pinned[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buf


def _bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _memory() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {"allocated": 0.0, "reserved": 0.0}
    return {"allocated": float(torch.cuda.memory_allocated()), "reserved": float(torch.cuda.memory_reserved())}


class Offloadable:
    """Trainer mixin: `offload` / `onload` of what `_state_tensors()` yields; `on_device(what)` brings an offloaded
    trainer back around a method that needs its state."""

    offloader: DeviceOffloader
    rank: int

    def _state_tensors(self) -> Iterable[torch.Tensor]:
        raise NotImplementedError

    def offload(self) -> dict[str, float]:
        return self.offloader.offload(self._state_tensors())

    def onload(self) -> dict[str, float]:
        return self.offloader.onload()

    @property
    def offloaded(self) -> bool:
        return self.offloader.offloaded

    @contextmanager
    def on_device(self, what: str):
        if not self.offloader.offloaded:
            yield
            return
        logger.info("rank %d: onloading for %s", self.rank, what)
        self.onload()
        try:
            yield
        finally:
            self.offload()
