"""Weight updates for the embedded engine: from a directory, or over a gloo group.

Receiving (disk reads, broadcasts) happens off the scheduler thread; only the
final in-place copy into the model runs on it, between decode steps (see
`Engine.apply_weights` in server.py).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch

from slime.utils.net import gloo_bind_host, gloo_group

logger = logging.getLogger(__name__)


def parse_dtype(name: str) -> torch.dtype:
    """'float32', 'bfloat16', 'torch.float16', ... -> torch.dtype."""
    key = name[len("torch."):] if name.startswith("torch.") else name
    dtype = getattr(torch, key, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: unknown dtype {name!r}")
    return dtype


def read_state_dict(model_path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Load a Hugging Face model directory and return its state dict (tied weights included)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model_path: {model_path!r} is not a directory")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return {k: v.detach() for k, v in model.state_dict().items()}


@torch.no_grad()
def copy_into_model(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> int:
    """Copy tensors into the model's parameters/buffers in place; every name must exist with the same shape."""
    targets = model.state_dict(keep_vars=True)
    problems = []
    for name, t in named.items():
        if name not in targets:
            problems.append(f"unknown parameter {name!r}")
        elif tuple(targets[name].shape) != tuple(t.shape):
            problems.append(f"{name}: shape {tuple(t.shape)} != model's {tuple(targets[name].shape)}")
    if problems:
        raise ValueError("; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""))
    for name, t in named.items():
        # one copy from wherever t lives (a CUDA IPC mapping, shared memory, a received buffer), converting dtype and
        # device on the way: a GPU engine fed CUDA tensors copies device to device, with no temporary
        targets[name].data.copy_(t)
    return len(named)


class WeightUpdateGroups:
    """gloo process groups that connect this engine to a trainer (rank 0 broadcasts)."""

    def __init__(self):
        self._groups: dict[str, tuple[object, object]] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str = "gloo", timeout_s: float = 120.0) -> None:
        if group_name in self._groups:
            raise ValueError(f"group_name: group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: unsupported backend {backend!r}")
        if backend == "nccl":
            logger.warning("backend 'nccl' requested; the CPU engine uses gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = torch.distributed.TCPStore(master_address, int(master_port), int(world_size), is_master=False, timeout=timeout)
        # a trainer on loopback gets a peer on loopback: gloo's default device would listen on the hostname's address
        pg = gloo_group(store, int(rank_offset), int(world_size), timeout, gloo_bind_host("", master_address))
        self._groups[group_name] = (store, pg)
        logger.info("weight update group %s: rank %s of %s via %s:%s", group_name, rank_offset, world_size, master_address, master_port)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        if group_name not in self._groups:
            raise ValueError(f"group_name: no weight update group {group_name!r}")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
        _, pg = self._groups[group_name]
        out = {}
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty([int(s) for s in shape], dtype=parse_dtype(dt))
            pg.broadcast(t, 0).wait()
            out[name] = t
        return out

    def destroy(self, group_name: str) -> bool:
        entry = self._groups.pop(group_name, None)
        if entry is None:
            return False
        _, pg = entry
        shutdown = getattr(pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - best effort at teardown
                logger.debug("process group shutdown failed", exc_info=True)
        del entry, pg
        return True

    def destroy_all(self) -> None:
        for name in list(self._groups):
            self.destroy(name)

    def __contains__(self, name: str) -> bool:
        return name in self._groups
