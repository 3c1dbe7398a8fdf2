"""The embedded engine served over HTTP."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import requests
import torch

from slime.utils.sglang_versions import SGLANG_PINNED
from hf_engine_reference import (_running_stream, _stream_until, _wait_idle, _wait_load, gen, greedy_reference,
                                 load_model, teacher_forced_logprobs, tiny_model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "hf_engine_model", seed=0)[0]


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return load_model(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, start_engine):
    return start_engine(model_dir, "--seed", "0", "--max-running-requests", "16")


def test_generate_response_shape(server):
    out = gen(server, [1, 5, 6, 7], rid="shape-1", sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert isinstance(meta["weight_version"], str)
    assert len(out["output_ids"]) == 6
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and all(x is None for _, _, x in lps)
    assert all(lp <= 0 for lp, _, _ in lps)


def test_info_endpoints(server, model_dir):
    info = server.get("/get_model_info").json()
    assert info["model_path"] == str(model_dir) and info["is_generation"] is True
    assert isinstance(info["weight_version"], str)
    si = server.get("/get_server_info").json()
    assert si["model_path"] == str(model_dir) and si["dp_size"] == 1 and si["max_running_requests"] == 16
    assert server.get("/server_info").json().keys() == si.keys()
    assert si["version"] == SGLANG_PINNED  # where SGLang reports its own version
    assert server.get("/model_info").json() == info
    loads = server.get("/v1/loads?include=core").json()
    assert loads["version"] == SGLANG_PINNED and len(loads["loads"]) == 1
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_running_requests", "dp_rank"} <= set(loads["loads"][0])
    assert "queues" not in loads["loads"][0] and "queues" in server.get("/v1/loads").json()["loads"][0]
    bad = server.get("/v1/loads?include=core,nope")
    assert bad.status_code == 400 and "nope" in bad.json()["detail"]
    # removed from SGLang in 0.5.21: not served
    assert server.get("/get_load").status_code == 404 and server.get("/get_weight_version").status_code == 404
    assert server.get("/v1/models").json()["data"][0]["id"] == str(model_dir)
    assert server.get("/health").status_code == 200
    assert server.get("/health_generate", timeout=30).status_code == 200


def test_health_passes_on_progress_while_its_own_request_waits(model_dir, start_engine, monkeypatch):
    """SGLang's rule for /health_generate."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "3")
    srv = start_engine(model_dir, "--max-running-requests", "1")
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    queue = [threading.Thread(target=srv.post, args=("/generate", body), kwargs={"timeout": 300}, daemon=True)
             for _ in range(40)]  # one row at a time: 40 x 200 tokens, far beyond 3 s
    for t in queue:
        t.start()
    assert _wait_load(srv, "num_waiting_reqs", 39, timeout=30)
    assert srv.get("/health_generate", timeout=30).status_code == 200  # its own turn is > 3 s away: 503 before
    assert srv.load()["num_waiting_reqs"] >= 30  # the queue was still there: answered on progress, not on its turn
    assert srv.post("/abort_request", {"abort_all": True}).status_code == 200
    assert _wait_idle(srv, timeout=30)


def test_freeze_gc_is_answered_as_sglang_does_and_serving_goes_on(server):
    for method in (server.post, server.get):  # SGLang routes both
        r = method("/freeze_gc")
        assert r.status_code == 200 and r.text == "Garbage collection frozen.\n"
    out = gen(server, [1, 5, 6], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3


def test_logprobs_match_teacher_forcing(server, ref_model):
    prompts = [[1, 5, 6, 7], [1, 12], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 20, 21], [1, 30, 31]]
    settings = [{"temperature": 0.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}, {"temperature": 1.0}]
    results = [None] * len(prompts)

    def run(i):
        sp = {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 100 + i, **settings[i]}
        results[i] = gen(server, prompts[i], sampling_params=sp)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for prompt, setting, out in zip(prompts, settings, results):
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        ref = teacher_forced_logprobs(ref_model, prompt, out["output_ids"], setting["temperature"])
        assert torch.allclose(got, ref, atol=1e-4), (setting, (got - ref).abs().max())
    assert results[0]["output_ids"] == greedy_reference(ref_model, prompts[0], 24)


def test_abort_returns_partial_and_resume_continues(server, ref_model):
    prompt, total = [1, 7, 8, 9], 200
    sp = {"max_new_tokens": total, "temperature": 0, "ignore_eos": True}
    full = gen(server, prompt, sampling_params=sp)["output_ids"]
    box = {"ready": threading.Event()}
    t = threading.Thread(target=_stream_until, args=(server, {"input_ids": prompt, "rid": "abort-me", "return_logprob": True, "sampling_params": sp}, 3, box))
    t.start()
    assert box["ready"].wait(30)
    assert server.post("/abort_request", {"rid": "abort-me"}).status_code == 200
    t.join(60)  # a safety net: the abort ends the stream
    assert not t.is_alive(), "the aborted stream did not end"
    part = box["final"]
    assert part["meta_info"]["finish_reason"]["type"] == "abort"  # ended by the abort, not by finishing
    k = len(part["output_ids"])
    assert 3 <= k < total
    assert len(part["meta_info"]["output_token_logprobs"]) == k
    assert part["output_ids"] == full[:k]
    rest = gen(server, prompt + part["output_ids"], sampling_params={**sp, "max_new_tokens": total - k})
    # the aborted request's KV was kept: the resumption prefilled nothing (SGLang reports it as cached_tokens)
    assert rest["meta_info"]["cached_tokens"] == len(prompt) + k - 1
    assert part["output_ids"] + rest["output_ids"] == full
    lps = [lp for lp, _, _ in part["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]]
    ref = teacher_forced_logprobs(ref_model, prompt, full, 0.0)
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)


def test_flush_cache_drops_aborted_kv_and_resume_prefills(server, ref_model):
    prompt, total = [1, 5, 6], 200
    sp = {"max_new_tokens": total, "temperature": 0, "ignore_eos": True}
    full = gen(server, prompt, sampling_params=sp)["output_ids"]
    box = {"ready": threading.Event()}
    body = {"input_ids": prompt, "rid": "flush-me", "return_logprob": True, "sampling_params": sp}
    t = threading.Thread(target=_stream_until, args=(server, body, 3, box))
    t.start()
    assert box["ready"].wait(30)
    assert server.post("/abort_request", {"rid": "flush-me"}).status_code == 200
    t.join(30)
    part = box["final"]["output_ids"]
    assert server.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"] >= 1
    assert server.post("/flush_cache").status_code == 200
    assert server.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"] == 0
    rest = gen(server, prompt + part, sampling_params={**sp, "max_new_tokens": total - len(part)})
    assert rest["meta_info"]["cached_tokens"] == 0  # prefilled again, same continuation
    assert part + rest["output_ids"] == full
    lps = [lp for lp, _, _ in rest["meta_info"]["output_token_logprobs"]]
    ref = teacher_forced_logprobs(ref_model, prompt, full, 0.0)[len(part):]
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)


def test_client_disconnect_cancels(server):
    """A running request held in place can only end by the disconnect of its client."""
    sp = {"max_new_tokens": 240, "temperature": 0, "ignore_eos": True}
    r = requests.post(server.url + "/generate", json={"input_ids": [1, 2, 3], "stream": True, "sampling_params": sp},
                      stream=True, timeout=60)
    assert r.status_code == 200
    assert _wait_load(server, "num_running_reqs", 1)
    assert server.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    try:
        r.close()
        assert _wait_idle(server)
        # a non-streaming client that gives up (its read timeout closes the connection) cancels its request
        failed = {}

        def give_up():
            try:
                requests.post(server.url + "/generate", json={"input_ids": [1, 2, 4], "sampling_params": sp}, timeout=(5, 3))
            except requests.exceptions.ReadTimeout as e:
                failed["timeout"] = e

        server.post("/continue_generation", {})
        c = threading.Thread(target=give_up)
        c.start()
        assert _wait_load(server, "num_running_reqs", 1)
        assert server.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
        c.join(30)
        assert "timeout" in failed and _wait_idle(server)
    finally:
        server.post("/continue_generation", {})


def test_control_endpoints_type_check_booleans(server):
    """`{"abort_all": "no"}` used to abort everything (a truthy string); now it is a 400 that aborts nothing."""
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    t, box = _running_stream(server, "keep-me", [1, 2, 3], sp, min_tokens=1)
    assert server.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    try:
        for body, field in [({"abort_all": "no"}, "abort_all"), ({"rid": 5}, "rid")]:
            r = server.post("/abort_request", body)
            assert r.status_code == 400 and field in r.json()["error"]["message"]
        assert server.load()["num_running_reqs"] == 1  # still there
        r = server.post("/update_weights_from_disk", {"model_path": "/nonexistent", "flush_cache": "no"})
        assert r.status_code == 400 and "flush_cache" in r.json()["error"]["message"]
        r = server.post("/update_weight_version", {"new_version": "9", "abort_all_requests": "false"})
        assert r.status_code == 400 and "abort_all_requests" in r.json()["error"]["message"]
        assert server.weight_version() != "9"
        assert server.post("/abort_request", {"rid": "keep-me"}).status_code == 200
        t.join(10)
        assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        server.post("/continue_generation", {})


def test_nonexistent_model_path_exits_nonzero(tmp_path):
    p = subprocess.run([sys.executable, "-m", "slime.backends.hf_engine", "--model-path", str(tmp_path / "nope"), "--port", "1"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--model-path" in p.stderr


def test_requests_join_and_leave_a_running_batch(server, ref_model):
    """A short request that arrives while a long one decodes joins the batch and finishes first, exactly."""
    long_sp = {"max_new_tokens": 220, "temperature": 0, "ignore_eos": True}
    box = {"ready": threading.Event()}
    t = threading.Thread(target=_stream_until, args=(server, {"input_ids": [1, 11, 12], "sampling_params": long_sp}, 5, box))
    t.start()
    assert box["ready"].wait(30)
    short = gen(server, [1, 13, 14, 15, 16, 17, 18], sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert t.is_alive(), "the long request should still be decoding"
    assert short["output_ids"] == greedy_reference(ref_model, [1, 13, 14, 15, 16, 17, 18], 8)
    t.join(60)
    assert box["final"]["output_ids"] == greedy_reference(ref_model, [1, 11, 12], 220)
