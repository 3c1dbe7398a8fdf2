"""Reading checkpoint files without running code (`weights_only=True` plus an allow-list; DCP metadata through a
restricted unpickler), with errors (`CheckpointFileError`) that name the file."""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from typing import Any, Iterable

import torch


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, corrupt, or would need code to load; the message names the file."""

    def __init__(self, path: str, cause: str):
        self.path = path
        self.cause = cause
        super().__init__(f"{path}: {cause}")


def safe_torch_load(path: str, allowed_globals: Iterable[Any] = ()) -> Any:
    """`torch.load(weights_only=True)` on CPU plus `allowed_globals`; `CheckpointFileError` for a bad file."""
    if not os.path.isfile(path):
        raise CheckpointFileError(path, "missing")
    if not zipfile.is_zipfile(path):
        raise CheckpointFileError(path, f"not a torch checkpoint (no zip archive in its {os.path.getsize(path)} bytes): "
                                        "corrupt or truncated")
    allowed = list(allowed_globals)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        try:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - only used to improve the message
            wanted = []
        names = {f"{g.__module__}.{g.__qualname__}" for g in allowed if hasattr(g, "__qualname__")}
        refused = [g for g in wanted if g not in names]
        if refused:
            raise CheckpointFileError(path, f"refused to load: it needs {', '.join(refused[:5])}, which could run code "
                                            "(only tensors, containers and numbers are loaded; a planted or foreign "
                                            "file?)") from None
        raise CheckpointFileError(path, f"corrupt: {str(e).strip().splitlines()[-1][:300]}") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as e:
        raise CheckpointFileError(path, f"corrupt or truncated ({type(e).__name__}: {str(e)[:300]})") from None


def check_torch_file(path: str, allowed_globals: Iterable[Any] = ()) -> None:
    """Without loading any tensor or running anything: the file is an intact torch archive whose pickle names
    only globals `safe_torch_load` accepts. Raises `CheckpointFileError` otherwise."""
    try:
        with zipfile.ZipFile(path) as z:
            z.infolist()
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointFileError(path, f"corrupt or truncated ({e})") from None
    try:
        wanted = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - an unreadable pickle is a corrupt file
        raise CheckpointFileError(path, f"corrupt ({type(e).__name__}: {str(e)[:200]})") from None
    names = {f"{g.__module__}.{g.__qualname__}" for g in allowed_globals if hasattr(g, "__qualname__")}
    refused = [g for g in wanted if g not in names]
    if refused:
        raise CheckpointFileError(path, f"refused to load: it needs {', '.join(refused[:5])}, which could run code "
                                        "(a planted or foreign file?)")


def _dcp_metadata_global(module: str, name: str) -> bool:
    """What a torch.distributed.checkpoint `.metadata` pickle may name: its own dataclasses and enums,
    torch dtypes / layouts / Size, and a few plain containers."""
    if module.startswith("torch.distributed.checkpoint."):
        return True
    if module == "torch.serialization" and name == "_get_layout":
        return True
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    return (module, name) in {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
                              ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f, allowed):
        super().__init__(f)
        self.allowed, self.refused = allowed, []

    def find_class(self, module: str, name: str):
        if not self.allowed(module, name):
            self.refused.append(f"{module}.{name}")
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def check_pickle_file(path: str, allowed=_dcp_metadata_global) -> None:
    """A raw pickle names only globals `allowed(module, name)` accepts (nothing else runs); `CheckpointFileError`."""
    try:
        with open(path, "rb") as f:
            unpickler = _RestrictedUnpickler(f, allowed)
            try:
                unpickler.load()
            except pickle.UnpicklingError as e:
                if unpickler.refused:
                    raise CheckpointFileError(path, f"refused to load: it needs {', '.join(unpickler.refused)}, which "
                                                    "could run code (a planted or foreign file?)") from None
                raise CheckpointFileError(path, f"corrupt ({e})") from None
    except CheckpointFileError:
        raise
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    except (EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError, KeyError) as e:
        raise CheckpointFileError(path, f"corrupt or truncated ({type(e).__name__}: {str(e)[:200]})") from None


def check_dist_checkpoint(path: str, allowed_globals: Iterable[Any] = ()) -> None:
    """A torch.distributed.checkpoint directory names no code but `allowed_globals` (no tensor read); raises
    `CheckpointFileError` naming the file."""
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointFileError(os.path.join(path, ".metadata"), "missing (not a complete dist-checkpoint)")
    check_pickle_file(os.path.join(path, ".metadata"))
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(".pt"):
            check_torch_file(full, allowed_globals)
        elif name.endswith(".json"):
            read_json_file(full)


def check_safetensors(path: str) -> dict[str, Any]:
    """A .safetensors header, checked against the file's size (cheap); `CheckpointFileError` for a bad file."""
    if not os.path.isfile(path):
        raise CheckpointFileError(path, "missing")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"only {size} bytes")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 1024**2):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
    except (ValueError, OSError) as e:
        raise CheckpointFileError(path, f"corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(path, "corrupt safetensors header (not an object)")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointFileError(path, f"truncated: its header describes {8 + n + end} bytes, the file has {size}")
    return header


def read_json_file(path: str) -> Any:
    """json.load with an error naming the file (missing, not UTF-8, or not JSON)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing") from None
    except UnicodeDecodeError as e:
        raise CheckpointFileError(path, f"corrupt: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise CheckpointFileError(path, f"corrupt: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
