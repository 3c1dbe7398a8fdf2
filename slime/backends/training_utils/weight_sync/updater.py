"""Push the trainer's weights to every rollout engine (`WeightUpdater`, both trainer backends).

Three paths (``--update-weight-mode``): distributed (trainer rank 0 broadcasts buckets of
``--update-weight-buffer-size`` bytes to the engines in SGLang's process-group layout,
`slime/utils/weight_update_group.py`, with a ``/update_weights_from_distributed`` POST per bucket), disk (a HF
directory and ``/update_weights_from_disk``) and tensor (CUDA IPC / shared memory, tensor.py). Every update sits in
SGLang's weight-update session (``/begin_weight_update`` .. ``/end_weight_update``; a 404 means none is needed), and
only the last bucket carries the caller's `flush_cache`, so the cache the old weights made is flushed once, after
the last load. Backends override `named_weights` and `write_hf`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.training_utils.weight_sync.engine_calls import post as _post, post_all as _post_all, wait_all as _wait_all
from slime.backends.sglang_utils.weight_session import WeightUpdateSessions
from slime.backends.training_utils.distributed import device, use_cuda
from slime.backends.training_utils.weight_sync.feed import EngineFeed, feed_plan
from slime.backends.training_utils.weight_sync.payload import buckets
from slime.backends.training_utils.weight_sync.tensor import TensorSender, buckets_with_last
from slime.utils import weight_update_group
from slime.utils.net import advertised_address, listen_socket, resolve_listen_host, serve_store

logger = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 600.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightUpdater:
    """Lives in every trainer rank; rank 0 talks to the engines (tensor mode: each engine's first feeding rank)."""

    def __init__(self, args, model: nn.Module, rank: int):
        if args.update_weights_from_disk and args.update_weight_mode != "disk":  # e.g. Args.replace of one of them
            raise ValueError(f"--update-weights-from-disk with --update-weight-mode {args.update_weight_mode}: "
                             "set update_weight_mode='disk' (parse_args derives it from the slime flag)")
        self.args = args
        self.model = model
        self.rank = rank
        self.group_name = "weight_update_group"
        self._pg = None
        self._urls: tuple[str, ...] = ()
        self._disk_dir: str | None = None
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="weight-sync")
        self._tensor: TensorSender | None = None
        self.buffer_bytes = args.update_weight_buffer_size
        self.timeout = HTTP_TIMEOUT_S

    # ------------------------------------------------------------ public ----
    def update(self, urls: list[str], version: int, feeds: list[EngineFeed] | None = None,
               flush_cache: bool = True) -> dict[str, float]:
        """Send the current weights to every worker in `urls` as `version` (tensor mode: to the engines of
        `feeds`, default every URL fed by rank 0), the engines' prefix cache flushed after the last load if
        `flush_cache`. Call on every trainer rank (the gathers are collectives)."""
        if not urls and not feeds:
            raise ValueError("update_weights: no engine worker URLs (is the EngineGroup started?)")
        t0 = time.perf_counter()
        mode = self.args.update_weight_mode
        if mode == "tensor":
            feeds = feeds or feed_plan(list(urls), 1, None)
            urls = [f.url for f in feeds]
        # rank 0 readies the engines (the group, the sessions); every rank learns whether that worked before the
        # collectives of the weight stream start
        sessions, error = None, None
        if self.rank == 0:
            try:
                if mode == "distributed" and tuple(urls) != self._urls:
                    self._connect(list(urls))
                if mode != "disk":  # SGLang loads from disk without a session
                    sessions = WeightUpdateSessions(self._pool, self.timeout)
                    sessions.open(list(urls))
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                error = e
        if self._agree(int(error is not None)):
            if error is not None:
                raise error
            raise RuntimeError(f"weight update to version {version}: trainer rank 0 could not reach the engines "
                               f"(see its log)")
        named = iter(self.named_weights(everywhere=(mode == "tensor")))  # tensor: streamed into the buckets
        n_bytes = 0
        try:
            if mode == "tensor":
                n_bytes = self._tensor_sender().send(feeds, named, version, flush_cache)
            elif self.rank == 0:
                if mode == "disk":
                    n_bytes = self._send_disk(list(urls), dict(named), version, flush_cache)
                else:
                    n_bytes = self._send_distributed(list(urls), named, version, flush_cache)
        except Exception as e:  # tell the other ranks before raising, so none waits forever
            error = e
        finally:
            for _ in named:  # every rank runs the gathers to the end, even after a failed send
                pass
        failed_rank = self._first_failed(error is not None)
        close_error = None
        if sessions is not None:  # every rank has sent its buckets: the engines finalise the new weights
            try:
                sessions.close(quiet=failed_rank is not None)
            except Exception as e:  # noqa: BLE001 - raised below, on every rank
                close_error = e
        if self._agree(int(close_error is not None)) and failed_rank is None:
            failed_rank, error = 0, close_error
        if failed_rank is not None:
            if error is not None:
                raise error
            raise RuntimeError(f"weight update to version {version} failed on trainer rank {failed_rank} (see its log)")
        dt = time.perf_counter() - t0
        logger.info("weights v%d -> %d engine(s) via %s in %.3fs", version, len(urls), mode, dt)
        return {"weight_sync_time_s": dt, "weight_sync_bytes": float(n_bytes),
                "weight_sync_from_disk": float(mode == "disk"), "weight_sync_tensor": float(mode == "tensor")}

    def _tensor_sender(self) -> TensorSender:
        if self._tensor is None:
            self._tensor = TensorSender(self.rank, dist.get_world_size(), self._pool, self.buffer_bytes, self.timeout)
        return self._tensor

    # ------------------------------------------------------ backend hooks ----
    def named_weights(self, everywhere: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        """Collective: (HF name, full tensor) pairs on rank 0 (other ranks may yield nothing), or with
        `everywhere` on every rank and on its device (tensor mode: each rank feeds the engine on its GPU)."""
        raise NotImplementedError(f"{type(self).__name__}: a trainer backend says how its weights are gathered")

    def write_hf(self, state: dict[str, torch.Tensor], path: str) -> None:
        """Rank 0: `state` as a HF model directory at `path` (the disk path)."""
        raise NotImplementedError(f"{type(self).__name__}: a trainer backend says how it writes a HF directory")

    def close(self) -> None:
        if self.rank == 0 and self._pg is not None:
            try:
                futs = _post_all(self._pool, list(self._urls), "/destroy_weights_update_group",
                                 {"group_name": self.group_name}, 30)
                _wait_all(futs, list(self._urls), "/destroy_weights_update_group", 35)
            except Exception as e:  # engines may already be gone at shutdown
                logger.warning("destroy_weights_update_group: %s", e)
            self._release_local()
        if self._disk_dir:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = None
        if self._tensor is not None:
            self._tensor.close()
            self._tensor = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------- helpers ----
    def _agree(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        t = torch.tensor([int(value)], dtype=torch.int64, device=device())  # NCCL on a GPU has no CPU backend
        dist.broadcast(t, src=0)
        return int(t.item())

    def _first_failed(self, failed: bool) -> int | None:
        """The lowest rank that failed, on every rank (None if none did)."""
        ws = dist.get_world_size()
        t = torch.tensor([self.rank if failed else ws], dtype=torch.int64, device=device())  # NCCL on a GPU has no CPU backend
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return None if int(t.item()) == ws else int(t.item())

    def _release_local(self) -> None:
        pg, self._pg, self._urls = self._pg, None, ()
        if pg is not None:
            try:
                weight_update_group.leave(pg)
            except Exception as e:  # noqa: BLE001 - teardown of a group a failure may have broken
                logger.debug("weight-update group teardown: %s", e)
        self._store = None

    def _connect(self, urls: list[str]) -> None:
        if self._pg is not None:
            self.close_group_only()
        tp = self.args.rollout_num_gpus_per_engine if use_cuda() else 1
        world_size = 1 + len(urls) * tp
        # the store listens on --listen-host only (torch's own TCPStore server would bind every interface),
        # resolved on this node: loopback on one machine, this node's address when engines run on others
        listen_host = resolve_listen_host(self.args.listen_host)
        sock = listen_socket(listen_host)
        port = sock.getsockname()[1]
        address = advertised_address(listen_host)
        backend = "nccl" if use_cuda() else "gloo"
        futs = []
        for i, url in enumerate(urls):
            payload = {"master_address": address, "master_port": port, "rank_offset": 1 + i * tp,
                       "world_size": world_size, "group_name": self.group_name, "backend": backend}
            futs.append(self._pool.submit(_post, url, "/init_weights_update_group", payload, self.timeout))
        try:
            timeout = timedelta(seconds=min(self.timeout, 300))
            store = serve_store(sock, world_size, timeout)
            pg = weight_update_group.join(backend, store, 0, world_size, self.group_name, timeout)
        except Exception:
            for f in futs:
                f.cancel()
            sock.close()  # no-op once the store took it over
            raise
        _wait_all(futs, urls, "/init_weights_update_group", self.timeout)
        self._store, self._pg, self._urls = store, pg, tuple(urls)
        logger.info("weight-update group %s: %d engine(s), world size %d, port %d (%s)",
                    self.group_name, len(urls), world_size, port, backend)

    def close_group_only(self) -> None:
        urls = list(self._urls)
        try:
            _wait_all(_post_all(self._pool, urls, "/destroy_weights_update_group",
                                {"group_name": self.group_name}, 30), urls, "/destroy_weights_update_group", 35)
        except Exception as e:
            logger.warning("destroy_weights_update_group: %s", e)
        self._release_local()

    def _send_distributed(self, urls: list[str], named: Iterable[tuple[str, torch.Tensor]], version: int,
                          flush_cache: bool) -> int:
        dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")
        n_bytes = 0
        for bucket, last in buckets_with_last(buckets, named, self.buffer_bytes):
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            payload = {
                "names": [n for n, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "weight_version": str(version),
                "flush_cache": flush_cache and last,  # once, after the last load (see the module docstring)
            }
            futs = _post_all(self._pool, urls, "/update_weights_from_distributed", payload, self.timeout)
            try:
                sent = [t.to(dev).contiguous() for _, t in bucket]
                self._wait_broadcasts([self._pg.broadcast(t, 0) for t in sent], futs, urls)
            except Exception as e:
                self._release_local()
                raise RuntimeError(f"weight broadcast to {urls} failed: {e}") from e
            _wait_all(futs, urls, "/update_weights_from_distributed", self.timeout)
        return n_bytes

    def _wait_broadcasts(self, works: list, futs: list, urls: list[str]) -> None:
        """Until every broadcast of a bucket is done; an engine that answers before taking part (it refused the
        bucket) fails it at once, naming the engine, instead of after the group's timeout."""
        deadline = time.monotonic() + self.timeout
        while not all(w.is_completed() for w in works):
            for fut, url in zip(futs, urls):
                if fut.done() and fut.exception() is not None:
                    raise RuntimeError(f"{url} refused the bucket: {fut.exception()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the broadcast did not finish within {self.timeout:.0f}s")
            time.sleep(0.001)
        for w in works:
            w.wait()

    def _send_disk(self, urls: list[str], state: dict[str, torch.Tensor], version: int, flush_cache: bool) -> int:
        if self._disk_dir is None:
            self._disk_dir = tempfile.mkdtemp(prefix="slime_weights_")
        path = os.path.join(self._disk_dir, f"v{version}")
        self.write_hf(state, path)
        payload = {"model_path": path, "weight_version": str(version), "flush_cache": flush_cache}
        _wait_all(_post_all(self._pool, urls, "/update_weights_from_disk", payload, self.timeout),
                  urls, "/update_weights_from_disk", self.timeout)
        for old in os.listdir(self._disk_dir):  # keep only the version the engines now serve
            if old != f"v{version}":
                shutil.rmtree(os.path.join(self._disk_dir, old), ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in state.values())

