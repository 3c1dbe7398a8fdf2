"""Weight updates of the embedded engine."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from hf_engine_reference import greedy_reference, tiny_model

PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models with the same architecture and different weights: a (served first), b (the update)."""
    return {name: tiny_model(tmp_path_factory, f"model_{name}", seed) for seed, name in enumerate("ab")}


@pytest.fixture(scope="module")
def server(models, start_engine):
    srv = start_engine(models["a"][0], "--seed", "0")
    yield srv
    # SIGINT shuts down cleanly too (start_engine stops the others with SIGTERM and checks the exit code)
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGINT)
        srv.proc.wait(20)


def greedy(server, ids, n):
    r = server.post("/generate", {"input_ids": ids, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def test_update_from_disk(server, models):
    (_, ma), (dir_b, mb) = models["a"], models["b"]
    before = greedy(server, PROMPT, 12)
    assert before["output_ids"] == greedy_reference(ma, PROMPT, 12)
    v0 = before["meta_info"]["weight_version"]

    r = server.post("/update_weights_from_disk", {"model_path": str(dir_b), "weight_version": "5"}).json()
    assert r["success"], r
    after = greedy(server, PROMPT, 12)  # the same prompt as before: no stale cache may answer
    assert after["output_ids"] == greedy_reference(mb, PROMPT, 12) != before["output_ids"]
    assert after["meta_info"]["weight_version"] == "5" != v0
    assert server.get("/get_model_info").json()["weight_version"] == "5"

    # no version given: it is bumped
    r = server.post("/update_weights_from_disk", {"model_path": str(models["a"][0])}).json()
    assert r["success"] and server.get("/get_model_info").json()["weight_version"] == "6"


def test_update_during_generation_stamps_each_token_with_its_version(server, models):
    """An update while a request runs (not paused)."""
    from slime.rollout.sampling_request import parse_segment
    from slime.utils.types import Sample

    server.post("/update_weights_from_disk", {"model_path": str(models["a"][0]), "weight_version": "10"})
    (_, ma), (dir_b, mb) = models["a"], models["b"]
    n = 150
    box = {}
    t = threading.Thread(target=lambda: box.update(out=greedy(server, PROMPT, n)))
    t.start()
    deadline = time.monotonic() + 30
    while server.load()["num_used_tokens"] < len(PROMPT) + 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = server.post("/update_weights_from_disk", {"model_path": str(dir_b), "weight_version": "11"}).json()
    assert r["success"], r
    assert r["num_paused_requests"] == 1  # the running request went on across the update
    t.join(60)
    out = box["out"]
    ids = out["output_ids"]
    assert len(ids) == n and out["meta_info"]["weight_version"] == "11"
    spans = out["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["10", "11"] and spans[0]["start"] == 0 and spans[1]["end"] == n
    k = spans[0]["end"]
    assert spans[1]["start"] == k and 5 <= k < n
    seq = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        la = ma(seq).logits[0, len(PROMPT) - 1: -1]
        lb = mb(seq).logits[0, len(PROMPT) - 1: -1]
    tok = torch.tensor(ids)
    lps = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    lp_a = torch.log_softmax(la, -1).gather(1, tok[:, None]).squeeze(1)
    lp_b = torch.log_softmax(lb, -1).gather(1, tok[:, None]).squeeze(1)
    # exactly the stamped boundary: old weights produced tokens [0, k), new weights [k, n)
    assert bool((la[:k].argmax(-1) == tok[:k]).all()) and bool((lb[k:].argmax(-1) == tok[k:]).all())
    assert torch.allclose(lps[:k], lp_a[:k], atol=1e-4) and torch.allclose(lps[k:], lp_b[k:], atol=1e-4)
    assert not torch.allclose(lps[k - 1: k + 1], lp_b[k - 1: k + 1], atol=1e-4)  # token k-1 was not from b
    got, _, versions, _, _ = parse_segment(out, server.url)
    sample = Sample(index=0, group_index=0, tokens=list(PROMPT))
    sample.append_response(got, lps.tolist(), versions)
    assert sample.weight_versions == [10] * k + [11] * (n - k)


def test_update_errors_are_reported(server, tmp_path):
    r = server.post("/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status_code == 400 and not r.json()["success"] and "model_path" in r.json()["message"]
    bad_group = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"}
    with server.weight_update_session():
        r = server.post("/update_weights_from_distributed", bad_group)
    assert r.status_code == 400 and not r.json()["success"] and "nope" in r.json()["message"]
    r = server.post("/update_weight_version", {"new_version": "42"}).json()
    assert r["success"] and server.get("/get_model_info").json()["weight_version"] == "42"
    assert greedy(server, PROMPT, 2)["meta_info"]["weight_version"] == "42"


def test_tensor_and_broadcast_updates_need_a_session_as_in_sglang(server, models):
    """SGLang >= 0.5.21: tensor and broadcast updates outside a weight-update session are refused untouched."""
    before = greedy(server, PROMPT, 6)["output_ids"]
    version = server.weight_version()
    for route in ("/update_weights_from_tensor", "/update_weights_from_distributed"):
        body = ({"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket"}
                if route.endswith("tensor") else {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]})
        r = server.post(route, {**body, "weight_version": "99"})
        assert r.status_code == 400 and r.json() == {
            "success": False, "message": f"{route[1:]} must run between begin_weight_update() and end_weight_update()"}
    assert server.weight_version() == version and greedy(server, PROMPT, 6)["output_ids"] == before
    assert server.post("/begin_weight_update", {}).json() == {"success": True, "message": "Success"}
    again = server.post("/begin_weight_update", {"selector": "all"})
    assert again.status_code == 400 and "already open" in again.json()["message"]
    assert server.post("/end_weight_update", {}).json()["success"]
    closed = server.post("/end_weight_update", {})
    assert closed.status_code == 400 and "no weight-update session is open" in closed.json()["message"]
    bad = server.post("/begin_weight_update", {"selector": "both"})
    assert bad.status_code == 400 and "selector" in bad.json()["error"]["message"]
    r = server.post("/update_weights_from_disk", {"model_path": str(models["a"][0]), "weight_version": "31"})
    assert r.json()["success"] and server.weight_version() == "31"
