"""The default process group and the device, for every trainer backend
(gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def use_cuda() -> bool:
    return torch.cuda.is_available()


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600) -> bool:
    """Create the default process group (gloo on CPU, nccl on GPU) unless one
    exists. Returns True when this call created it (so the caller destroys it)."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a default process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"wanted {rank}/{world_size}"
            )
        return False
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if use_cuda() else "gloo"
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    logger.info("rank %d/%d: %s process group on %s:%d", rank, world_size, backend, master_addr, master_port)
    return True


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")
