"""The embedded engine's SGLang memory and tensor endpoints."""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time

import pytest
import torch

from hf_engine_reference import greedy_reference, tiny_model
from slime.backends.training_utils.weight_sync.payload import dtype_buckets, flatten_bucket, serialize

torch.set_num_threads(1)
WORDS = [str(i) for i in range(10)] + list("abcdefghij")
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: tiny_model(tmp_path_factory, f"model_{name}", seed, words=WORDS) for seed, name in enumerate("ab")}


def _start(models, start_engine, *flags):
    """An engine with SGLang's weight-update session open."""
    srv = start_engine(models["a"][0], "--seed", "0", *flags)
    assert srv.post("/begin_weight_update", {}).json()["success"]
    return srv


@pytest.fixture(scope="module")
def server(models, start_engine):
    srv = _start(models, start_engine, "--enable-memory-saver")
    yield srv
    assert srv.post("/end_weight_update", {}).json()["success"]
    srv.stop()


def greedy(server, n=6):
    r = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                            "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def memory(server) -> dict:
    return server.get("/get_server_info").json()["internal_states"][0]["memory"]


def tensor_body(model, version, max_bytes=1 << 14, load_format="flattened_bucket"):
    """One /update_weights_from_tensor body per bucket of `model`'s weights (CPU: shared memory)."""
    named = [(k, v.detach()) for k, v in model.state_dict().items()]
    if load_format != "flattened_bucket":
        return [{"serialized_named_tensors": [serialize(named)], "load_format": load_format,
                 "weight_version": str(version)}]
    return [{"serialized_named_tensors": [serialize(flatten_bucket(b))], "load_format": "flattened_bucket",
             "weight_version": str(version), "flush_cache": True} for b in dtype_buckets(named, max_bytes)]


def push(server, model, version, **kw):
    for body in tensor_body(model, version, **kw):
        r = server.post("/update_weights_from_tensor", body)
        assert r.status_code == 200 and r.json()["success"], r.text


def test_release_frees_memory_refuses_generation_and_resume_needs_new_weights(server, models):
    (_, ma), (_, mb) = models["a"], models["b"]
    before = greedy(server)
    assert before == greedy_reference(ma, PROMPT, 6)
    full = memory(server)
    assert full["released"] == [] and full["weight_bytes"] > 0 and full["kv_cache_bytes"] > 0

    r = server.post("/release_memory_occupation", {})  # no tags: all of them (SGLang)
    assert r.status_code == 200 and r.json()["success"], r.text
    gone = memory(server)
    assert gone["released"] == ["kv_cache", "weights"]
    assert gone["weight_bytes"] == 0 and gone["kv_cache_bytes"] == 0  # storage really freed

    refused = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503 and "release_memory_occupation" in refused.text
    assert server.get("/health_generate").status_code == 200  # alive, deliberately not generating
    # weights cannot be written while released
    r = server.post("/update_weights_from_tensor", tensor_body(mb, 7)[0])
    assert r.status_code == 400 and "resume_memory_occupation" in r.json()["message"]

    assert server.post("/resume_memory_occupation", {"tags": ["weights"]}).json()["success"]
    assert memory(server)["weight_bytes"] == full["weight_bytes"]
    still = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert still.status_code == 503 and "kv_cache" in still.text

    push(server, mb, 7)  # the trainer writes the weights while the KV cache is still released
    refused = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert refused.status_code == 503
    assert server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).json()["success"]
    assert memory(server)["released"] == []
    assert greedy(server) == greedy_reference(mb, PROMPT, 6)
    assert server.get("/get_model_info").json()["weight_version"] == "7"

    push(server, ma, 8, load_format="direct")  # back to a: list of (name, tensor) pairs
    assert greedy(server) == before


def test_resumed_weights_without_backup_wait_for_every_parameter(server, models):
    (_, ma), _ = models["a"], models["b"]
    assert server.post("/release_memory_occupation", {"tags": ["weights"]}).json()["success"]
    assert server.post("/resume_memory_occupation", {"tags": None}).json()["success"]
    bodies = tensor_body(ma, 9, max_bytes=1 << 12)
    assert len(bodies) > 2
    for body in bodies[:-1]:
        assert server.post("/update_weights_from_tensor", body).json()["success"]
        r = server.post("/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 503 and "have not been written" in r.text
    assert server.post("/update_weights_from_tensor", bodies[-1]).json()["success"]
    assert greedy(server) == greedy_reference(ma, PROMPT, 6)


def test_weights_cpu_backup_restores_on_resume(models, start_engine):
    srv = _start(models, start_engine, "--enable-memory-saver", "--enable-weights-cpu-backup")
    try:
        before = greedy(srv)
        assert srv.post("/release_memory_occupation", {"tags": ["weights", "kv_cache"]}).json()["success"]
        assert memory(srv)["weight_bytes"] == 0
        assert srv.post("/resume_memory_occupation", {}).json()["success"]
        assert greedy(srv) == before
    finally:
        srv.stop()


def test_release_needs_the_memory_saver_flag_and_an_idle_engine(models, start_engine, server):
    plain = _start(models, start_engine)
    try:
        r = plain.post("/release_memory_occupation", {})
        assert r.status_code == 400 and "--enable-memory-saver" in r.json()["message"]
        assert greedy(plain)  # nothing changed
    finally:
        plain.stop()

    box = {}
    t = threading.Thread(target=lambda: box.update(r=server.post("/generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})))
    t.start()
    deadline = time.monotonic() + 30
    while server.load()["num_running_reqs"] < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    r = server.post("/release_memory_occupation", {})
    assert r.status_code == 400 and "idle" in r.json()["message"]
    server.post("/abort_request", {"abort_all": True})
    t.join(30)
    assert box["r"].status_code == 200
    assert memory(server)["released"] == []


@pytest.mark.parametrize("body, field", [
    ({"tags": ["weights", "gpu"]}, "tags"),
    ({"tags": "weights"}, "tags"),
    ({"tags": ["kv_cache"], "mode": 1}, "mode"),
])
def test_bad_memory_requests_name_the_field(server, body, field):
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        r = server.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text
    assert memory(server)["released"] == []
    assert greedy(server)


class _Evil:
    def __reduce__(self):
        import os

        return os.system, ("true",)


def _b64(obj) -> str:
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def _bad_bodies(model):
    good = tensor_body(model, 1)[0]
    entry = good["serialized_named_tensors"][0]
    flat = flatten_bucket([("model.norm.weight", model.state_dict()["model.norm.weight"])])
    meta = flat["metadata"][0]
    out_of_range = {"flattened_tensor": flat["flattened_tensor"],
                    "metadata": [type(meta)(**{**vars(meta), "end_idx": meta.end_idx + 5, "numel": meta.numel + 5})]}
    wrong_shape = {"flattened_tensor": flat["flattened_tensor"],
                   "metadata": [type(meta)(**{**vars(meta), "shape": torch.Size([3, 7])})]}
    return [
        ({}, "serialized_named_tensors: missing"),
        ({"serialized_named_tensors": entry}, "serialized_named_tensors: expected list"),
        ({"serialized_named_tensors": []}, "serialized_named_tensors: one entry per TP rank"),
        ({"serialized_named_tensors": [entry, entry], "load_format": "flattened_bucket"}, "serialized_named_tensors: one entry"),
        ({"serialized_named_tensors": ["%%%"], "load_format": "flattened_bucket"}, "serialized_named_tensors[0]: not valid base64"),
        ({"serialized_named_tensors": [_b64(_Evil())]}, "serialized_named_tensors[0]: refers to posix.system"),
        ({**good, "load_format": "my.loader"}, "load_format"),
        ({**good, "load_format": None}, "serialized_named_tensors[0]: expected a list of (name, tensor) pairs"),
        ({**good, "flush_cache": "yes"}, "flush_cache"),
        ({**good, "weight_version": [1]}, "weight_version"),
        ({**good, "model_path": "/x"}, "model_path: unknown field"),
        ({"serialized_named_tensors": [serialize(out_of_range)], "load_format": "flattened_bucket"},
         "serialized_named_tensors[0].metadata[0]"),
        ({"serialized_named_tensors": [serialize(wrong_shape)], "load_format": "flattened_bucket"},
         "serialized_named_tensors[0].metadata[0].shape"),
        ({"serialized_named_tensors": [serialize([("model.nope.weight", torch.zeros(2))])]}, "unknown parameter"),
        ({"serialized_named_tensors": [serialize([("model.norm.weight", torch.zeros(3))])]}, "model.norm.weight: shape"),
    ]


def test_bad_tensor_payloads_are_refused_and_the_engine_keeps_serving(server, models):
    _, ma = models["a"]
    push(server, ma, 20)
    before = greedy(server)
    for body, expected in _bad_bodies(ma):
        r = server.post("/update_weights_from_tensor", body)
        assert 400 <= r.status_code < 500, (body.keys(), r.text)
        reply = r.json()
        msg = reply["message"] if "message" in reply else reply["error"]["message"]
        assert expected in msg, (expected, msg)
        assert greedy(server) == before  # serving, on unchanged weights
    assert server.get("/get_model_info").json()["weight_version"] == "20"


def _abort_a_running_request(server) -> dict:
    """A long request aborted mid-generation: its KV blocks go to the prefix cache (for its resumption)."""
    out = {}
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}}
    t = threading.Thread(target=lambda: out.update(r=server.post("/generate", body)))
    t.start()
    deadline = time.monotonic() + 60
    while server.load()["num_running_reqs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert server.post("/abort_request", {"abort_all": True}).status_code == 200
    t.join(60)
    meta = out["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    return meta


def _prefix_entries(server) -> int:
    return server.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"]


def test_paged_kv_is_flushed_by_tensor_updates_and_freed_by_release(server, models):
    """The paged KV pool holds the running rows' and the prefix cache's blocks."""
    (_, ma), _ = models["a"], models["b"]
    meta = _abort_a_running_request(server)
    assert meta["completion_tokens"] > 0 and _prefix_entries(server) == 1
    for body in tensor_body(ma, 30):  # the same weights, keeping KV computed by them
        r = server.post("/update_weights_from_tensor", {**body, "flush_cache": False})
        assert r.status_code == 200 and r.json()["success"], r.text
    assert _prefix_entries(server) == 1
    push(server, ma, 31)  # flush_cache: true
    assert _prefix_entries(server) == 0

    _abort_a_running_request(server)
    assert _prefix_entries(server) == 1 and memory(server)["kv_cache_bytes"] > 0
    assert server.post("/release_memory_occupation", {"tags": ["kv_cache"]}).json()["success"]
    assert _prefix_entries(server) == 0 and memory(server)["kv_cache_bytes"] == 0
    assert server.post("/resume_memory_occupation", {"tags": ["kv_cache"]}).json()["success"]
    assert greedy(server) == greedy_reference(ma, PROMPT, 6)  # the pool is allocated again on its first write
    assert memory(server)["kv_cache_bytes"] > 0
