"""`--update-weight-mode tensor`: the trainer's weights reach colocated engines by reference.

Per bucket of one dtype (at most --update-weight-buffer-size bytes) each feeding rank (`feed.py`) flattens its
HF-named tensors and serializes them for `/update_weights_from_tensor` (payload.py); the engine's first feeding
rank posts its TP ranks' payloads in order. The flat tensor lives until the engine replies; then, on a GPU,
`torch.cuda.ipc_collect()` frees the closed IPC handles. Only the last bucket says `flush_cache` (see updater.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from slime.backends.training_utils.weight_sync.engine_calls import post
from slime.backends.training_utils.weight_sync.feed import EngineFeed
from slime.backends.training_utils.weight_sync.payload import dtype_buckets, flatten_bucket, serialize

logger = logging.getLogger(__name__)

PATH = "/update_weights_from_tensor"


class _Tracked:
    """An iterator that knows when its source ran out."""

    def __init__(self, items: Iterable):
        self._it = iter(items)
        self.exhausted = False

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            self.exhausted = True
            raise


def buckets_with_last(bucketer, named: Iterable, max_bytes: int) -> Iterator[tuple[list, bool]]:
    """`bucketer(named, max_bytes)`'s buckets, each with whether it is the last. A bucketer cuts a bucket when the
    next tensor does not fit (it has read it) or when the stream ends, so this reads nothing ahead of it."""
    source = _Tracked(named)
    for bucket in bucketer(source, max_bytes):
        yield bucket, source.exhausted


def release_ipc_handles(device: torch.device) -> None:
    """After the engines replied to a bucket on `device`: free the CUDA IPC memory whose handles they closed."""
    if device.type == "cuda":
        torch.cuda.ipc_collect()


class TensorSender:
    """Lives in every trainer rank; ranks that feed no engine only drain the collective weight stream."""

    def __init__(self, rank: int, world_size: int, pool: ThreadPoolExecutor | None, buffer_bytes: int,
                 timeout: float):
        self.rank = rank
        self.world_size = world_size
        self.pool = pool or ThreadPoolExecutor(max_workers=4, thread_name_prefix="weight-sync-tensor")
        self.buffer_bytes = buffer_bytes
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], object] = {}
        # CPU: each bucket's shared-memory segment is kept for the next sync (creating and faulting in a
        # segment per sync cost more than the copy); on a GPU buckets are freed (device memory is dearer)
        self._buffers: dict[int, torch.Tensor] = {}

    def _group(self, ranks: tuple[int, ...]):
        """A gloo group over one engine's feeding ranks (created on every rank, in plan order: a collective)."""
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), backend="gloo")
        return self._groups[ranks]

    def send(self, feeds: list[EngineFeed], named: Iterable[tuple[str, torch.Tensor]], version: int,
             flush_cache: bool = True) -> int:
        """Every rank calls this with the same `feeds`; `named` yields full tensors on every feeding rank (the last
        bucket carries `flush_cache`). Returns the bytes handed over by this rank. Raises on this rank's failure
        after draining `named`."""
        for f in feeds:  # same order on every rank
            if len(f.ranks) > 1:
                self._group(f.ranks)
        mine = [f for f in feeds if self.rank in f.ranks]
        n_bytes, error = 0, None
        for i, (bucket, last) in enumerate(buckets_with_last(dtype_buckets, named, self.buffer_bytes)):
            if not mine:
                continue  # not a feeder: the stream's collectives still ran
            flat = flatten_bucket(bucket, self._buffers.get(i))
            device = flat["flattened_tensor"].device
            if device.type == "cpu":
                self._buffers[i] = flat["flattened_tensor"]
            n_bytes += flat["flattened_tensor"].numel() * flat["flattened_tensor"].element_size()
            try:
                self._send_bucket(mine, flat, version, error is None, flush_cache and last)
            except Exception as e:  # keep draining: the other ranks wait in the same collectives
                error = error or e
            del flat, bucket  # the engines have copied it (or failed)
            release_ipc_handles(device)
        if error is not None:
            raise error
        return n_bytes

    def _send_bucket(self, mine: list[EngineFeed], flat: dict, version: int, post_it: bool, flush: bool) -> None:
        body = {"load_format": "flattened_bucket", "flush_cache": flush,
                "weight_version": str(version)}
        futures, error = [], None
        for f in mine:
            payload = serialize(flat)  # one per engine: each receiver takes its own shared-memory reference
            if len(f.ranks) == 1:
                entries = [payload]
            else:
                entries = [None] * len(f.ranks) if self.rank == f.leader else None
                dist.gather_object(payload, entries, dst=f.leader, group=self._groups[f.ranks])
            if self.rank == f.leader and post_it:
                futures.append((f, self.pool.submit(post, f.url, PATH, {**body, "serialized_named_tensors": entries},
                                                    self.timeout)))
        for f, fut in futures:
            try:
                fut.result(timeout=self.timeout + 5)
            except Exception as e:
                error = error or RuntimeError(f"weight update: {PATH} on worker {f.url} failed: {e}")
        for f in mine:  # the leader says when the engine is done with every member's memory
            if len(f.ranks) > 1:
                status = [0 if error is None else 1]
                dist.broadcast_object_list(status, src=f.leader, group=self._groups[f.ranks])
                if status[0] and error is None:
                    error = RuntimeError(f"weight update: {PATH} on worker {f.url} failed (see trainer rank {f.leader})")
        if error is not None:
            raise error

    def close(self) -> None:
        for g in self._groups.values():
            try:
                dist.destroy_process_group(g)
            except Exception as e:  # noqa: BLE001 - teardown
                logger.debug("destroy feed group: %s", e)
        self._groups.clear()
        self._buffers.clear()
