"""Run megatron-core on a machine without CUDA (CI, laptops): its calls for the current device, synchronize, the
CUDA RNG, `device="cuda"` factories, `Tensor.cuda()` and `torch.cuda.*` type checks are answered with the CPU from
the outside, once per process, applied only when CUDA is absent. `device="cuda"` factories are redirected only
inside the megatron modules that call them: a process-wide patch of `torch.zeros` & co. confuses torch's own
device contexts. The one visible process-wide change: `Tensor.type()` names CPU tensors `torch.cuda.*`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
import types

import torch

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
_APPLIED = threading.Event()
# torch factories megatron calls with device="cuda", and the megatron modules that do
_FACTORIES = frozenset({"tensor", "zeros", "ones", "empty", "full", "arange", "randn", "rand", "empty_like",
                        "zeros_like", "ones_like"})
_CUDA_FACTORY_MODULES = (
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.data",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.pipeline_parallel.schedules",
)


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _CpuTorch(types.ModuleType):
    """`torch` as one megatron module sees it: factories make CPU tensors where megatron asks for CUDA ones."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return _cpu_factory(attr) if name in _FACTORIES else attr


def _cuda_type_name(original):
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class CpuRNGStatesTracker:
    """megatron's CUDA RNG tracker over the CPU generator: `fork(name)` swaps to the named stream and back."""

    def __init__(self):
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already used")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def apply() -> None:
    """Idempotent; call before building any megatron object (CUDA absent only)."""
    if torch.cuda.is_available():
        raise RuntimeError("the megatron CPU shim must not be applied when CUDA is available")
    with _LOCK:
        if _APPLIED.is_set():
            return
        from megatron.core.tensor_parallel import random as mrandom

        proxy = _CpuTorch()
        for name in _CUDA_FACTORY_MODULES:
            importlib.import_module(name).torch = proxy
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.Tensor.type = _cuda_type_name(torch.Tensor.type)
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.manual_seed = lambda *args, **kwargs: None
        # recompute (activation checkpointing) saves and restores "the CUDA RNG": here, the CPU one
        mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
        # model_parallel_cuda_manual_seed() reuses an initialised tracker: give it ours
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
        _APPLIED.set()
    logger.info("megatron-core on CPU: CUDA calls answered by slime.backends.megatron_utils.cpu_shim")
