"""Weight updates for the embedded engine: from a directory, or over a weight-update group joined as SGLang joins it
(`init_custom_process_group`, `slime/utils/weight_update_group.py`). Receiving happens off the scheduler thread;
only the in-place copy into the model runs on it, between steps (`Engine._apply`).
"""

from __future__ import annotations

import datetime
import logging
import os

import torch

from slime.utils import weight_update_group
from slime.utils.net import gloo_bind_host, pin_collectives

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
    """Process groups that connect this engine to a trainer (rank 0 broadcasts): gloo, or NCCL on a GPU."""

    def __init__(self):
        self._groups: dict[str, tuple[object, object]] = {}

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str = "gloo", timeout_s: float = 120.0) -> None:
        if group_name in self._groups:
            raise ValueError(f"group_name: group {group_name!r} already exists")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: unsupported backend {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend: 'nccl' needs CUDA, which this engine does not have; the trainer asks for 'gloo' "
                             "on CPU")
        timeout = datetime.timedelta(seconds=timeout_s)
        # gloo listens where the trainer can reach it: loopback for a loopback trainer (the engine's own process)
        pin_collectives(gloo_bind_host("", master_address) or master_address)
        store = torch.distributed.TCPStore(master_address, int(master_port), int(world_size), is_master=False,
                                           timeout=timeout)
        pg = weight_update_group.join(backend, store, int(rank_offset), int(world_size), group_name, timeout)
        self._groups[group_name] = (store, pg, "cuda" if backend == "nccl" else "cpu")
        logger.info("weight update group %s: rank %s of %s via %s:%s (%s)", group_name, rank_offset, world_size,
                    master_address, master_port, backend)

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        if group_name not in self._groups:
            raise ValueError(f"group_name: no weight update group {group_name!r}")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
        _, pg, device = self._groups[group_name]
        out = {}
        for name, dt, shape in zip(names, dtypes, shapes):
            t = torch.empty([int(s) for s in shape], dtype=parse_dtype(dt), device=device)
            pg.broadcast(t, 0).wait()
            out[name] = t
        return out

    def destroy(self, group_name: str) -> bool:
        entry = self._groups.pop(group_name, None)
        if entry is None:
            return False
        pg = entry[1]
        try:
            weight_update_group.leave(pg)
        except Exception:  # noqa: BLE001 - best effort at teardown
            logger.debug("process group teardown failed", exc_info=True)
        del entry, pg
        return True

    def destroy_all(self) -> None:
        for name in list(self._groups):
            self.destroy(name)

    def __contains__(self, name: str) -> bool:
        return name in self._groups


class WeightUpdateSession:
    """SGLang's weight-update session (0.5.21+): tensor and distributed updates are refused outside
    `/begin_weight_update` ... `/end_weight_update`; disk updates need none."""

    SELECTORS = ("target", "draft", "all")

    def __init__(self):
        self.selector: str | None = None

    @property
    def is_open(self) -> bool:
        return self.selector is not None

    def begin(self, selector: str) -> tuple[bool, str]:
        if selector not in self.SELECTORS:
            raise ValueError(f"selector: invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if self.is_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.selector = selector
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.is_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.selector = None
        return True, "Success"

    def refusal(self, route: str) -> str | None:
        """Why an update through `route` is refused now (None: it may run)."""
        if self.is_open:
            return None
        return f"{route} must run between begin_weight_update() and end_weight_update()"
