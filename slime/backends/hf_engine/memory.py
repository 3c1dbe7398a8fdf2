"""The engine's memory occupation: SGLang's `/release_memory_occupation` and `/resume_memory_occupation`.

Colocated with a trainer, an engine frees `weights` (storage resized to 0 bytes) and `kv_cache` between rollouts.
The KV cache comes back empty; weights come back undefined (as with SGLang's `--enable-memory-saver`) and generation
is refused until every parameter is written again, unless `--enable-weights-cpu-backup` kept a host copy. Releasing
needs an idle engine; every method runs on the scheduler thread, between steps.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
ALL_TAGS = (TAG_WEIGHTS, TAG_KV_CACHE, TAG_CUDA_GRAPH)


class MemoryStateError(ValueError):
    """A memory call that cannot run in the engine's current state (busy, not enabled)."""


def parse_tags(tags) -> list[str]:
    """SGLang's `tags`: null or [] means all; anything else must be a list of known tags."""
    if tags is None or tags == []:
        return list(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags: expected null or a list of strings, got {tags!r}")
    unknown = [t for t in tags if t not in ALL_TAGS]
    if unknown:
        raise ValueError(f"tags: unknown tag {unknown[0]!r} (SGLang's tags: {', '.join(ALL_TAGS)})")
    return list(dict.fromkeys(tags))


class EngineMemory:
    def __init__(self, model: torch.nn.Module, scheduler, enabled: bool, cpu_backup: bool):
        self.model = model
        self.scheduler = scheduler
        self.enabled = enabled
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        # one entry per distinct parameter (tied weights share one), under every name it has
        self._params: dict[int, torch.nn.Parameter] = {}
        self._param_of_name: dict[str, int] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            self._params.setdefault(id(p), p)
            self._param_of_name[name] = id(p)
        if enabled:  # weights loaded from a memory-mapped file cannot be resized: give them their own storage
            with torch.no_grad():
                for p in self._params.values():
                    if not p.untyped_storage().resizable():
                        p.data = p.data.clone()
        self._sizes: dict[int, int] = {}  # bytes of each released parameter's storage
        self._backup: dict[int, torch.Tensor] = {}
        self._stale: set[int] = set()  # resumed without a backup: not written since

    # ---- state ---------------------------------------------------------------------------
    def generation_blocker(self) -> str | None:
        """Why /generate is refused now, or None."""
        if self.released:
            return (f"the engine's memory is released ({', '.join(sorted(self.released))}) by "
                    f"/release_memory_occupation; POST /resume_memory_occupation first")
        if self._stale:
            return (f"the weights were resumed without a backup and {len(self._stale)} of {len(self._params)} "
                    f"parameters have not been written since; send a weight update first")
        return None

    @property
    def weights_released(self) -> bool:
        return TAG_WEIGHTS in self.released

    def weight_bytes(self) -> int:
        return sum(p.untyped_storage().nbytes() for p in self._params.values())

    def note_loaded(self, names) -> None:
        """A weight update wrote these tensors (state-dict names)."""
        for n in names:
            self._stale.discard(self._param_of_name.get(n, -1))

    def state(self) -> dict:
        out = {"released": sorted(self.released), "stale_parameters": len(self._stale),
               "weight_bytes": self.weight_bytes(), "kv_cache_bytes": self.scheduler.kv_cache_bytes()}
        p = next(self.model.parameters(), None)
        if p is not None and p.device.type == "cuda":  # what the device itself says (freed means given back)
            free, total = torch.cuda.mem_get_info(p.device)
            out.update(device_allocated_bytes=torch.cuda.memory_allocated(p.device),
                       device_reserved_bytes=torch.cuda.memory_reserved(p.device), device_free_bytes=free,
                       device_total_bytes=total)
        return out

    # ---- release / resume --------------------------------------------------------------------
    def release(self, tags: list[str]) -> str:
        if not self.enabled:
            raise MemoryStateError("release_memory_occupation needs the engine started with --enable-memory-saver "
                                   "(SGLang's flag); without it no memory would be freed")
        sched = self.scheduler
        busy = sched.num_running + sched.num_waiting
        if busy:
            raise MemoryStateError(f"release_memory_occupation needs an idle engine; {busy} requests are running "
                                   f"or waiting (abort them first)")
        done = []
        if TAG_KV_CACHE in tags and TAG_KV_CACHE not in self.released:
            freed = sched.release_kv_cache()
            self.released.add(TAG_KV_CACHE)
            done.append(f"kv_cache ({freed} bytes)")
        if TAG_WEIGHTS in tags and TAG_WEIGHTS not in self.released:
            done.append(f"weights ({self._release_weights()} bytes)")
            self.released.add(TAG_WEIGHTS)
        # the decode graphs hold the weights' and the KV pool's addresses: any release drops them (captured again later)
        graphs = sched.batch.graphs
        shapes = graphs.drop()
        if TAG_CUDA_GRAPH in tags:
            done.append(f"cuda_graph ({shapes} decode graph shapes; {graphs.captures} captures in "
                        f"{graphs.capture_s:.2f}s so far)")
        _empty_device_cache(self.model)
        return "released " + (", ".join(done) if done else "nothing (already released)")

    def resume(self, tags: list[str]) -> str:
        done = []
        if TAG_WEIGHTS in tags and TAG_WEIGHTS in self.released:
            self._resume_weights()
            self.released.discard(TAG_WEIGHTS)
            done.append("weights" + (" (restored from the CPU backup)" if self.cpu_backup else
                                     " (contents undefined until the next weight update)"))
        if TAG_KV_CACHE in tags and TAG_KV_CACHE in self.released:
            self.scheduler.resume_kv_cache()
            self.released.discard(TAG_KV_CACHE)
            done.append("kv_cache")
        return "resumed " + (", ".join(done) if done else "nothing (not released)")

    @torch.no_grad()
    def _release_weights(self) -> int:
        freed = 0
        for key, p in self._params.items():
            storage = p.untyped_storage()
            n = storage.nbytes()
            if self.cpu_backup:
                host = self._backup.get(key)
                if host is None or host.numel() != n:
                    host = self._backup[key] = torch.empty(n, dtype=torch.uint8, device="cpu",
                                                           pin_memory=storage.device.type == "cuda")
                host.copy_(_bytes_view(storage, n))
            self._sizes[key] = n
            storage.resize_(0)
            freed += n
        return freed

    @torch.no_grad()
    def _resume_weights(self) -> None:
        for key, p in self._params.items():
            storage = p.untyped_storage()
            n = self._sizes.pop(key)
            storage.resize_(n)
            view = _bytes_view(storage, n)
            if self.cpu_backup:
                view.copy_(self._backup[key])
            else:
                view.zero_()  # defined bytes, though not weights: generation waits for the update
        if not self.cpu_backup:
            self._stale = set(self._params)


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


def _empty_device_cache(model: torch.nn.Module) -> None:
    p = next(model.parameters(), None)
    if p is not None and p.device.type == "cuda":
        torch.cuda.empty_cache()
