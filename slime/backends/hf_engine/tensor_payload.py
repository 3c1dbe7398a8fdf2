"""Reading SGLang's `/update_weights_from_tensor` payload.

One entry per TP rank: base64 of a `ForkingPickler` pickle (SGLang's `MultiprocessingSerializer`) holding CUDA IPC
handles (device by index or UUID) or shared memory by file name (file-descriptor payloads are refused). An entry is
a list of (name, tensor) pairs (`load_format` null or "direct") or a "flattened_bucket" (one flat tensor and its
metadata, as SGLang's `FlattenedTensorBucket`). The unpickler resolves only the globals such payloads need; every
problem is a `PayloadError` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle
import types

import torch
from torch.multiprocessing import reductions

LOAD_FORMATS = (None, "direct", "flattened_bucket")


class PayloadError(ValueError):
    """The payload is malformed; the message names the field."""


def _rebuild_cuda_tensor(*args):
    """torch's CUDA IPC rebuild, taking the device as an index or (SGLang's patched reductions) a GPU UUID."""
    device = args[6]
    if isinstance(device, str):
        matches = [i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise PayloadError(f"a CUDA tensor lives on GPU {device}, which this engine cannot see")
        args = (*args[:6], matches[0], *args[7:])
    return reductions.rebuild_cuda_tensor(*args)


def _refuse_fd(*_args):
    raise PayloadError("CPU tensors were shared by file descriptor (torch's file_descriptor strategy), which cannot "
                       "cross unrelated processes; share them with the file_system strategy")


class FlattenedTensorMetadata(types.SimpleNamespace):
    """Stands in for SGLang's class of the same name when a payload refers to it."""


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    (_REDUCTIONS, "rebuild_tensor"): reductions.rebuild_tensor,
    (_REDUCTIONS, "rebuild_typed_storage"): reductions.rebuild_typed_storage,
    (_REDUCTIONS, "rebuild_storage_filename"): reductions.rebuild_storage_filename,
    (_REDUCTIONS, "rebuild_storage_empty"): reductions.rebuild_storage_empty,
    (_REDUCTIONS, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    (_REDUCTIONS, "rebuild_storage_fd"): _refuse_fd,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        hit = _ALLOWED.get((module, name))
        if hit is not None:
            return hit
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PayloadError(f"refers to {module}.{name}, which a weight payload has no use for (refused)")


def decode_entry(entry, where: str):
    """One base64 entry of `serialized_named_tensors` -> the pickled object (tensors mapped, not copied)."""
    if isinstance(entry, str):
        try:
            raw = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise PayloadError(f"{where}: not valid base64 ({e})") from None
    else:
        raise PayloadError(f"{where}: expected a base64 string, got {type(entry).__name__}")
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except PayloadError as e:
        raise PayloadError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a corrupt pickle or a stale shared-memory handle
        raise PayloadError(f"{where}: cannot be unpickled as a MultiprocessingSerializer payload "
                           f"({type(e).__name__}: {e})") from None


def _named_pairs(obj, where: str) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, (list, tuple)):
        raise PayloadError(f"{where}: expected a list of (name, tensor) pairs for this load_format, "
                           f"got {type(obj).__name__}")
    out = []
    for i, pair in enumerate(obj):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise PayloadError(f"{where}[{i}]: expected a (name, tensor) pair")
        out.append((pair[0], pair[1]))
    return out


def _bucket(obj, where: str) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise PayloadError(f"{where}: expected a dict with flattened_tensor and metadata (load_format "
                           f"flattened_bucket), got {got}")
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise PayloadError(f"{where}.flattened_tensor: expected a 1-D tensor")
    if not isinstance(metadata, (list, tuple)):
        raise PayloadError(f"{where}.metadata: expected a list")
    out = []
    for i, meta in enumerate(metadata):
        at = f"{where}.metadata[{i}]"
        try:
            name, shape, dtype = meta.name, meta.shape, meta.dtype
            start, end, numel = meta.start_idx, meta.end_idx, meta.numel
        except AttributeError as e:
            raise PayloadError(f"{at}: {e}") from None
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise PayloadError(f"{at}: name must be a string and dtype a torch.dtype")
        if not (isinstance(shape, (tuple, list)) and all(isinstance(s, int) and s >= 0 for s in shape)):
            raise PayloadError(f"{at}.shape: expected a list of sizes, got {shape!r}")
        if not all(isinstance(v, int) for v in (start, end, numel)) or not 0 <= start <= end <= flat.numel():
            raise PayloadError(f"{at}: start_idx/end_idx {start}..{end} outside the flattened tensor "
                               f"({flat.numel()} elements)")
        if end - start != numel:
            raise PayloadError(f"{at}: end_idx - start_idx = {end - start} but numel = {numel}")
        piece = flat[start:end]
        if flat.dtype != dtype:
            if flat.dtype != torch.uint8:
                raise PayloadError(f"{at}.dtype: {dtype} in a {flat.dtype} bucket (a bucket of several dtypes "
                                   f"must be uint8, indexed in bytes)")
            item = torch.empty((), dtype=dtype).element_size()
            if numel % item:
                raise PayloadError(f"{at}: {numel} bytes is not a whole number of {dtype} elements")
            piece = piece.view(dtype)
        if piece.numel() != math.prod(shape):
            raise PayloadError(f"{at}.shape: {list(shape)} needs {math.prod(shape)} elements, the slice has "
                               f"{piece.numel()}")
        out.append((name, piece.reshape(tuple(shape))))
    return out


def decode(serialized_named_tensors, load_format: str | None, tp_rank: int = 0,
           tp_size: int = 1) -> list[tuple[str, torch.Tensor]]:
    """This TP rank's (name, tensor) pairs. The tensors alias the sender's memory: copy them before replying."""
    field = "serialized_named_tensors"
    if load_format not in LOAD_FORMATS:
        raise PayloadError(f"load_format: {load_format!r} is not supported (null, \"direct\" or "
                           f"\"flattened_bucket\"; custom weight loaders are not)")
    if not isinstance(serialized_named_tensors, list):
        raise PayloadError(f"{field}: expected a list with one entry per TP rank")
    if len(serialized_named_tensors) != tp_size:
        raise PayloadError(f"{field}: one entry per TP rank is expected; this engine has {tp_size} TP rank(s), "
                           f"got {len(serialized_named_tensors)} entries")
    where = f"{field}[{tp_rank}]"
    obj = decode_entry(serialized_named_tensors[tp_rank], where)
    return _bucket(obj, where) if load_format == "flattened_bucket" else _named_pairs(obj, where)
