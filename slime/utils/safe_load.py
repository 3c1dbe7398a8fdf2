"""Reading checkpoint files without running code, with errors that name the file.

`torch.load(weights_only=False)` unpickles arbitrary objects, so a planted
`optimizer.pt` runs code on `--load`. Every torch file we read goes through
`safe_torch_load`: `weights_only=True` (tensors, containers, numbers, strings)
plus an explicit allow-list of extra globals; anything else is refused with
the globals it asked for. Corrupt or truncated files (torch, safetensors,
JSON) raise `CheckpointFileError` naming the file and the cause. The Megatron
trainer's own files (dist_checkpointing's common state) use the same helper.
"""

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
    """`torch.load(path, weights_only=True)` on CPU, with `allowed_globals` added to torch's safe list.

    Raises `CheckpointFileError` for a missing, corrupt or code-carrying file (nothing in it runs).
    """
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


def check_safetensors(path: str) -> dict[str, Any]:
    """Parse a .safetensors header and check that the data it describes is all there; returns the header.

    Cheap (reads only the header); raises `CheckpointFileError` for a missing, truncated or corrupt file.
    """
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
