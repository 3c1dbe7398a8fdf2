"""The stand-ins `sglang_real_server.py` runs SGLang's own code with: its GPU packages (below), the model
(`StandInModel`) and the scheduler process (`StandInScheduler`).

SGLang's modules import GPU-only packages (triton, flashinfer, sgl_kernel, ...) at import time, though the code
we drive (HTTP routes, request types, scheduler weight-update code, unpickler, process-group helper) never calls
them on CPU. `install()` puts a meta-path finder in front that answers those names, and only those, with inert
modules: any attribute is an inert class (subclassable, callable, usable as a decorator or a pydantic field type);
`triton.runtime.driver.active` raises, so SGLang's device probes answer "cpu".
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import sys
import types

# GPU kernels and GPU-only helpers, and a few optional media/parsing packages SGLang imports at module level
STOOD_IN = frozenset({
    "triton", "sgl_kernel", "flashinfer", "torch_memory_saver", "torchao", "compressed_tensors", "xgrammar", "vllm",
    "kernels", "tvm_ffi", "cuda", "pynvml", "partial_json_parser", "sentencepiece", "soundfile", "torchaudio",
    "torchvision", "einops", "watchfiles", "IPython",
})
RAISING = frozenset({"triton.runtime.driver.active"})


def _any_schema(cls, source, handler):
    from pydantic_core import core_schema

    return core_schema.any_schema()


class _InertMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{cls.__qualname__}.{name}" in RAISING:
            raise RuntimeError("no GPU driver on this machine")
        return _inert_class(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # a decorator: the function stays as it is
        return cls

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


def _inert_class(qualname: str):
    module, _, name = qualname.rpartition(".")
    return _InertMeta(name, (), {"__qualname__": qualname, "__module__": module,
                                 "__get_pydantic_core_schema__": classmethod(_any_schema)})


class InertModule(types.ModuleType):
    def __getattr__(self, name):
        if name == "__version__":
            return "0.0.0"
        if name.startswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in RAISING:
            raise RuntimeError("no GPU driver on this machine")
        return _inert_class(f"{self.__name__}.{name}")


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        module = InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STOOD_IN:
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def install() -> None:
    """Call before importing sglang. torch's compiler stack and transformers are imported first, so that they
    see the real (absent) packages and cache that; SGLang then gets the stand-ins."""
    import torch._inductor.compile_fx  # noqa: F401  (SGLang's module-level torch.compile reaches it)
    from transformers import AutoConfig

    register = AutoConfig.register

    def register_once(*args, **kwargs):  # older SGLang registers configs newer transformers already has
        return register(*args, **{**kwargs, "exist_ok": True})

    AutoConfig.register = staticmethod(register_once)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def stood_in() -> list[str]:
    """The packages SGLang actually imported through the stand-ins."""
    return sorted({n.split(".")[0] for n, m in sys.modules.items() if isinstance(m, InertModule)})


class StandInModel:
    """The model: `load_weights` (SGLang's model API) keeps a copy of every tensor it is given, by name."""

    def __init__(self):
        self.loaded: dict = {}
        self.loads = 0

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.detach().to("cpu").clone()
        self.loads += 1
        return set(self.loaded)

    def modules(self):
        return iter(())

    def named_modules(self, *a, **k):
        return iter(())

    def named_parameters(self, *a, **k):
        return iter(())

    def named_buffers(self, *a, **k):
        return iter(())

    def parameters(self, *a, **k):
        return iter(())

    def digest(self) -> dict:
        import torch

        out = {}
        for name, t in self.loaded.items():
            raw = t.contiguous().view(torch.uint8) if t.numel() else t
            out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                         "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest()}
        return out


class StandInScheduler:
    """The scheduler process: its request queue is a count; control requests go to SGLang's own handlers."""

    def __init__(self, abort_rounds: int):
        self.running = 0
        self.abort_rounds = abort_rounds
        self._aborts_left = 0
        self.paused = False
        self.weight_version = None
        self.aborts = 0
        self.flushes = 0

    def is_fully_idle(self, *args, **kwargs) -> bool:
        return self.running == 0

    def flush_cache(self, *args, **kwargs) -> bool:
        if not self.is_fully_idle():
            return False
        self.flushes += 1
        return True

    def record_weight_version_change(self, new_version=None, **kwargs):
        if new_version is not None:
            self.weight_version = new_version

    def set_running(self, n: int) -> None:
        self.running = n
        self._aborts_left = self.abort_rounds if n else 0

    def abort(self, req) -> None:
        self.aborts += 1
        if getattr(req, "abort_all", False) and self.running:
            self._aborts_left -= 1
            if self._aborts_left <= 0:
                self.running = 0
