"""Decode attention on the CPU without gathering the KV: `paged_decode.c`, built on first use and loaded with ctypes.

The kernel walks each row's block table in place (one (row, KV head) per OpenMP iteration, on torch's libgomp)
instead of copying the keys out of the pool. The build is cached under $SLIME_KERNEL_CACHE or
~/.cache/slime-april/kernels; when it cannot be built `load` says why once and returns None (the torch path stays).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_decode.c")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno"]
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
         ctypes.c_void_p] + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]


class DecodeKernel:
    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._fn = lib.paged_decode
        self._fn.argtypes = _ARGS
        self._fn.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, last: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
        """Attention of decode queries q [b, Hq, D] over one pool layer kv [2, Hkv, blocks, block size, D]: row r
        attends positions 0 .. last[r] (its own included), held in blocks table[r] ([b, m]). Returns [b, Hq, D],
        or None where the kernel does not apply (a dtype or layout it does not take)."""
        b, hq, d = q.shape
        if (q.dtype != torch.float32 or kv.dtype != torch.float32 or q.device.type != "cpu" or q.stride(2) != 1
                or not kv.is_contiguous()):
            return None
        table = table.reshape(b, -1).contiguous()
        keys = (last.reshape(b) + 1).contiguous()
        out = torch.empty(b, hq, d, dtype=torch.float32)
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), table.data_ptr(), keys.data_ptr(),
                      out.data_ptr(), b, hq, d, kv.shape[1], kv.shape[2], kv.shape[3], table.shape[1], float(scale),
                      torch.get_num_threads())
        return out if rc == 0 else None


def _cache_dir() -> str:
    return os.environ.get("SLIME_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "slime-april",
                                                                  "kernels")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _torch_libgomp() -> str | None:
    """The libgomp torch loaded (its wheels bundle one), so that the kernel links the same OpenMP runtime."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = sorted(f for f in os.listdir(lib) if f.startswith("libgomp")) if os.path.isdir(lib) else []
    return os.path.join(lib, found[0]) if found else None


def build(cc: str | None = None) -> str:
    """The kernel's shared library (built unless cached); raises with the compiler's message when it cannot be."""
    cc = cc or os.environ.get("CC") or "cc"
    exe = shutil.which(cc)
    if exe is None:
        raise FileNotFoundError(f"no C compiler {cc!r} on PATH")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    gomp = _torch_libgomp()
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + repr((CFLAGS, version, _cpu_flags(), gomp)).encode()).hexdigest()[:16]
    out = os.path.join(_cache_dir(), f"paged_decode-{key}.so")
    if os.path.exists(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    link = [gomp, f"-Wl,-rpath,{os.path.dirname(gomp)}"] if gomp else []
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(out))
    os.close(fd)
    try:
        done = subprocess.run([exe, *CFLAGS, "-o", tmp, SOURCE, *link, "-lm"], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{exe} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: engines starting at once each build, one file wins
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out


@functools.lru_cache(maxsize=None)
def load(cc: str | None = None) -> DecodeKernel | None:
    """The kernel, or None (with the reason logged once) where it cannot be built or loaded here."""
    try:
        path = build(cc)
        return DecodeKernel(ctypes.CDLL(path), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.info("CPU decode attention: the torch path (gather + SDPA); the paged kernel is not available: %s", e)
        return None
