"""The default process group and the device, for every trainer backend (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from slime.utils.net import (WILDCARDS, advertised_address, listen_socket, pin_collectives, resolve_listen_host,
                             serve_store, source_address_towards)

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def use_cuda() -> bool:
    return torch.cuda.is_available()


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600,
                     listen_host: str = "auto", listen_sock: socket.socket | None = None) -> bool:
    """Create the default process group unless one exists; True when this call created it. Rank 0 serves the
    store on `listen_sock` (or on `listen_host`, never every interface); under torchrun the group joins its
    agent's store."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a default process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"wanted {rank}/{world_size}"
            )
        return False
    timeout = timedelta(seconds=timeout_s)
    listen_host = resolve_listen_host(listen_host)
    local = listen_host if listen_host not in WILDCARDS else (source_address_towards(master_addr) or listen_host)
    pin_collectives(local)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and listen_sock is None:
        store = None  # torchrun's agent store (env://)
    elif rank == 0:
        sock = listen_sock if listen_sock is not None else listen_socket(listen_host, master_port or 0)
        master_port = sock.getsockname()[1]
        store = serve_store(sock, world_size, timeout)
    else:
        store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if use_cuda() else "gloo"
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    logger.info("rank %d/%d: %s process group on %s:%d", rank, world_size, backend, master_addr, master_port)
    return True


def open_master_port(listen_host: str) -> tuple[socket.socket, str, int]:
    """Rank 0's store socket on `listen_host` (kept open so no other process takes the port), address, port."""
    host = resolve_listen_host(listen_host)
    sock = listen_socket(host)
    return sock, advertised_address(host), sock.getsockname()[1]


def compile_ops(args) -> bool:
    """Whether `--compile-ops` fuses the trainer's element-wise work here (auto: on a GPU)."""
    if args.compile_ops not in ("auto", "on", "off"):
        raise ValueError(f"--compile-ops must be auto, on or off, got {args.compile_ops!r}")
    return args.compile_ops == "on" or (args.compile_ops == "auto" and use_cuda())


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")


def physical_device_index() -> int | None:
    """This process's accelerator as an index among the node's devices (None on CPU)."""
    if not use_cuda():
        return None
    idx = torch.cuda.current_device()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return idx
    if not visible[idx].isdigit():
        raise RuntimeError(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} names devices by UUID; "
                           "colocated weight handover needs node-level GPU indices")
    return int(visible[idx])
