"""An independent reader of SGLang's /update_weights_from_tensor payload, for the GPU box (SGLang itself cannot
be installed there; on CPU, tests/test_sglang_contract.py reads our payloads with SGLang's own code). Written
from SGLang 0.5.23's format (utils.MultiprocessingSerializer + SafeUnpickler, patch_torch.
monkey_patch_torch_reductions, weight_sync/tensor_bucket.FlattenedTensorBucket); it imports nothing from slime.

`deserialize` unpickles one base64 entry of `serialized_named_tensors` as an SGLang TP worker does, with an exact
(module, name) allow-list as SGLang's SafeUnpickler has since 0.5.21: here only the globals a weight payload can
need, each of them on SGLang's list (so this reader is stricter than SGLang, never looser); CUDA tensors rebuild
with the device given as an index or a GPU UUID (SGLang's reductions patch). `reconstruct_bucket` rebuilds a
"flattened_bucket" entry from metadata read by attribute, both ways SGLang has done it (element slices in the
bucket's dtype, and byte slices viewed as the tensor's dtype), which must agree. Run as a tiny HTTP worker
(`python tests/sglang_format_reader.py --port P --out DIR`) it reads every TP rank's entry of each
POST /update_weights_from_tensor and saves the tensors to DIR/bucket_NNNN.pt, the request's fields to
DIR/requests.jsonl; a POST /update_weights_from_disk reads the directory's *.safetensors files (as SGLang's
DefaultModelLoader does, safetensors.torch) into DIR/disk_NNNN.pt. `ReaderServer` starts that worker for a test.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from torch.multiprocessing import reductions

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED = {
    ("builtins", "bool"), ("builtins", "dict"), ("builtins", "float"), ("builtins", "int"), ("builtins", "list"),
    ("builtins", "str"), ("builtins", "tuple"), ("collections", "OrderedDict"), ("copyreg", "__newobj__"),
    ("types", "SimpleNamespace"),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "device"), ("torch", "dtype"),
    ("torch.nn.parameter", "Parameter"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
    (_REDUCTIONS, "rebuild_tensor"), (_REDUCTIONS, "rebuild_cuda_tensor"), (_REDUCTIONS, "rebuild_storage_fd"),
    (_REDUCTIONS, "rebuild_storage_filename"), (_REDUCTIONS, "rebuild_storage_empty"),
    (_REDUCTIONS, "rebuild_typed_storage"), (_REDUCTIONS, "rebuild_typed_storage_child"),
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
} | {("torch", name) for name in ("bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
                                  "uint8", "bool", "float8_e4m3fn", "float8_e5m2")}


def rebuild_cuda_tensor_by_uuid(*args):
    """What SGLang's patched rebuild does with argument 6: a GPU UUID becomes this process's device index."""
    dev = args[6]
    if isinstance(dev, str):
        dev = next(i for i in range(torch.cuda.device_count()) if str(torch.cuda.get_device_properties(i).uuid) == dev)
    return reductions.rebuild_cuda_tensor(*args[:6], dev, *args[7:])


class SGLangUnpickler(pickle.Unpickler):
    globals_seen: list

    def find_class(self, module, name):
        self.globals_seen.append(f"{module}.{name}")
        if (module, name) not in ALLOWED:
            raise pickle.UnpicklingError(f"refused {module}.{name} (not on the allow-list)")
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return rebuild_cuda_tensor_by_uuid  # monkey_patch_torch_reductions() runs before deserializing
        return super().find_class(module, name)


def deserialize(entry: str, globals_seen: list):
    raw = base64.b64decode(entry, validate=True)
    u = SGLangUnpickler(io.BytesIO(raw))
    u.globals_seen = globals_seen
    return u.load()


def reconstruct_bucket(obj) -> dict[str, torch.Tensor]:
    flat, metadata = obj["flattened_tensor"], obj["metadata"]
    out = {}
    for meta in metadata:
        piece = flat[meta.start_idx: meta.end_idx]
        newer = piece.view(meta.dtype).reshape(meta.shape)  # uint8-capable reader
        older = piece.reshape(meta.shape)  # element-indexed reader
        if older.dtype != meta.dtype:
            older = older.to(meta.dtype)
        assert meta.numel == meta.end_idx - meta.start_idx, meta
        assert torch.equal(newer, older), f"{meta.name}: the two SGLang readers disagree"
        out[meta.name] = newer.clone()
    return out


class Handler(BaseHTTPRequestHandler):
    out_dir = "."
    lock = threading.Lock()
    count = [0]

    def log_message(self, *a):  # quiet
        pass

    def _reply(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(200, {"ok": True})

    def do_POST(self):
        if self.path not in ("/update_weights_from_tensor", "/update_weights_from_disk"):
            return self._reply(404, {"error": self.path})
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/update_weights_from_disk":
            return self._from_disk(req)
        try:
            entries = req["serialized_named_tensors"]
            seen: list = []
            per_rank = []
            for entry in entries:  # each TP worker reads its own entry
                obj = deserialize(entry, seen)
                if req.get("load_format") == "flattened_bucket":
                    per_rank.append(reconstruct_bucket(obj))
                else:
                    per_rank.append({n: t.clone() for n, t in obj})
                del obj
        except Exception as e:  # noqa: BLE001 - reported like SGLang does
            return self._reply(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
        self._record("bucket", per_rank, {k: v for k, v in req.items() if k != "serialized_named_tensors"}
                     | {"entries": len(entries), "globals": sorted(set(seen))})

    def _from_disk(self, req: dict) -> None:
        from safetensors.torch import load_file

        try:
            names = sorted(n for n in os.listdir(req["model_path"]) if n.endswith(".safetensors"))
            state = {k: v for n in names for k, v in load_file(os.path.join(req["model_path"], n)).items()}
        except Exception as e:  # noqa: BLE001 - reported like SGLang does
            return self._reply(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
        self._record("disk", state, req | {"files": len(names)})

    def _record(self, kind: str, tensors, fields: dict) -> None:
        """Saves what a request carried as <kind>_NNNN.pt and its fields as a line of requests.jsonl; replies."""
        with self.lock:
            i = self.count[0]
            self.count[0] += 1
            torch.save(tensors, os.path.join(self.out_dir, f"{kind}_{i:04d}.pt"))
            with open(os.path.join(self.out_dir, "requests.jsonl"), "a") as f:
                f.write(json.dumps(fields) + "\n")
        self._reply(200, {"success": True, "message": "Success"})


class ReaderServer:
    """This module as a worker in a subprocess (for tests): `.url`, what it read (`received`, `out`), `stop`.
    `wait=False` returns at once; `wait_ready(url)` (from any process) waits for the worker to answer."""

    def __init__(self, out_dir, wait: bool = True):
        import socket
        import subprocess
        import sys

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.out = out_dir
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--port", str(port), "--out", str(out_dir)])
        if wait:
            wait_ready(self.url)

    def received(self) -> tuple[list[list[dict]], list[dict]]:
        buckets = [torch.load(p) for p in sorted(self.out.glob("bucket_*.pt"))]
        reqs = [json.loads(line) for line in (self.out / "requests.jsonl").read_text().splitlines()]
        return buckets, reqs

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def wait_ready(url: str, timeout: float = 120.0) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"sglang_format_reader at {url} did not answer within {timeout:.0f}s")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    Handler.out_dir = a.out
    ThreadingHTTPServer(("127.0.0.1", a.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
