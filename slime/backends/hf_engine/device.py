"""Where the embedded engine runs (--device, --dtype: the CPU or one CUDA GPU), and the step's host-to-device copies:
everything a step needs from the host is copied in from pinned memory before the forward, so the host waits for the
device once per step, when the sampled tokens come back.
"""

from __future__ import annotations

import os

import torch

from slime.backends.hf_engine import weights


class DeviceError(ValueError):
    """--device or --dtype names something this machine or engine cannot run on; the message says which."""


def resolve_device(name: str) -> torch.device:
    """--device: auto (cuda when torch sees a GPU, else cpu, as SGLang picks its device), cpu, cuda or cuda:N."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DeviceError(f"--device: {name!r} is not a device (auto, cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"--device: the embedded engine runs on cpu or cuda (ROCm included), not {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {name}: no CUDA device is visible here (torch {torch.__version__}, "
                              f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device) -> str:
    """--dtype: auto is float32 on the CPU (16-bit matmuls are slow there) and the checkpoint's own dtype on a GPU
    (transformers' dtype="auto", which this returns for it)."""
    if name == "auto":
        return "float32" if device.type == "cpu" else "auto"
    try:
        dtype = weights.parse_dtype(name)
    except ValueError:
        raise DeviceError(f"--dtype: unknown dtype {name!r} (auto, float32, bfloat16, float16)") from None
    if not dtype.is_floating_point:
        raise DeviceError(f"--dtype: {name!r} is not a floating-point type")
    return str(dtype).removeprefix("torch.")


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device` without making the host wait: pinned, then an asynchronous copy (torch's
    pinned-memory cache keeps the buffer until the copy is done). On the CPU, `t` itself."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
