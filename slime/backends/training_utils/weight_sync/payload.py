"""Writing SGLang's `/update_weights_from_tensor` payload (the trainer side).

An entry is what SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` makes: base64 of a
`ForkingPickler` pickle whose tensors travel by reference (CUDA: an IPC handle with the GPU's UUID, as SGLang's
patched reductions write it; CPU: shared memory under a file name). The sender keeps the tensors alive until the
engine has replied. Buckets use `flattened_bucket` with one dtype each; the metadata are `types.SimpleNamespace`
objects with SGLang's `FlattenedTensorMetadata` fields, so no SGLang import is needed.
"""

from __future__ import annotations

import base64
import io
import types
from multiprocessing.reduction import ForkingPickler
from typing import Iterable, Iterator

import torch
from torch.multiprocessing import reductions

_CUDA_DEVICE_ARG = 6  # position of the device index in torch's rebuild_cuda_tensor arguments


def _gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor(t: torch.Tensor):
    if t.requires_grad:
        t = t.detach()
    rebuild, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_CUDA_DEVICE_ARG], _gpu_uuid(args[_CUDA_DEVICE_ARG]), *args[_CUDA_DEVICE_ARG + 1:])
    return rebuild, args


def _reduce_storage(storage: torch.UntypedStorage):
    """CPU storages by shared-memory file name, whatever the process's sharing strategy."""
    if storage.device.type != "cpu":
        return reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return reductions.rebuild_storage_empty, (type(storage),)
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild takes this reference
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


class _TensorPickler(ForkingPickler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage


def serialize(obj) -> str:
    """`MultiprocessingSerializer.serialize(obj, output_str=True)`: base64 text of the pickle."""
    buf = io.BytesIO()
    _TensorPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def buckets(named: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], max_bytes: int,
            one_dtype: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive (name, tensor) pairs in buckets of at most `max_bytes` (a larger tensor travels alone), and with
    `one_dtype` of one dtype and device (a bucket flattened into one buffer). Lazy: a bucket is cut as soon as it is
    full, so a streaming source never holds more than one."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in (named.items() if isinstance(named, dict) else named):
        nbytes = t.numel() * t.element_size()
        other_kind = one_dtype and cur and (t.dtype != cur[0][1].dtype or t.device != cur[0][1].device)
        if cur and (size + nbytes > max_bytes or other_kind):
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield cur


def dtype_buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`buckets` of one dtype and device each: what `flatten_bucket` packs into one buffer."""
    return buckets(named, max_bytes, one_dtype=True)


def shared_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor to fill; on CPU it lives in shared memory (a named segment), so serializing it moves no bytes."""
    flat = torch.empty(numel, dtype=dtype, device=device)
    if flat.device.type == "cpu":
        flat.untyped_storage()._share_filename_cpu_()
    return flat


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> dict:
    """{"flattened_tensor", "metadata"} of one dtype's tensors (SGLang's FlattenedTensorBucket, element units),
    copied into `out` when it has the right size, dtype and device (a buffer reused across syncs), else into a
    new `shared_buffer`."""
    if not bucket:
        raise ValueError("flatten_bucket: empty bucket")
    first = bucket[0][1]
    total = sum(t.numel() for _, t in bucket)
    ok = out is not None and out.numel() == total and out.dtype == first.dtype and out.device == first.device
    flat = out if ok else shared_buffer(total, first.dtype, first.device)
    metadata, start = [], 0
    with torch.no_grad():
        for name, t in bucket:
            if t.dtype != first.dtype:
                raise ValueError(f"flatten_bucket: {name} is {t.dtype} in a {first.dtype} bucket")
            n = t.numel()
            flat[start:start + n].copy_(t.reshape(-1))
            metadata.append(types.SimpleNamespace(name=name, shape=torch.Size(t.shape), dtype=t.dtype,
                                                  start_idx=start, end_idx=start + n, numel=n))
            start += n
    return {"flattened_tensor": flat, "metadata": metadata}
