"""The embedded engine's pause modes and updates of a paused engine as SGLang 0.5.23 does them (hf_engine/pause.py).

Tokens and log-probs are checked against the models: in_place goes on over the old KV, retract recomputes."""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch

import pause_reference
from hf_engine_reference import _running_stream, gen, tiny_model
from pause_reference import decode_over_cache, teacher_forced
from slime.backends.hf_engine.pause import FLUSH_FAILED

PROMPT = [1, 5, 6, 7, 8]
N = 150


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two models with the same architecture and different weights: a (served first) and b (the update)."""
    return {name: tiny_model(tmp_path_factory, f"pause_model_{name}", seed) for seed, name in enumerate("ab")}


@pytest.fixture(scope="module")
def server(models, start_engine):
    return start_engine(models["a"][0], "--seed", "0")


@pytest.fixture
def on_a(server, models):
    """The engine serves model a as version 10, nothing running, nothing paused, nothing cached."""
    server.post("/continue_generation", {})
    r = server.post("/update_weights_from_disk", {"model_path": str(models["a"][0]), "weight_version": "10"})
    assert r.json()["success"], r.text
    return server


def update_to_b(server, models, flush: bool) -> requests.Response:
    return server.post("/update_weights_from_disk", {"model_path": str(models["b"][0]), "weight_version": "11",
                                                     "flush_cache": flush})


def running(server, rid: str, n: int = N, ready_at: int = 5, extra_key: str | None = None):
    return pause_reference.running(server.url, PROMPT, rid, n, ready_at, extra_key)


def split(final: dict):
    return pause_reference.split(final, "10", "11")


def test_in_place_update_keeps_the_rows_and_the_old_weights_kv(on_a, models):
    """Paused in place, an update with flush_cache=true loads the weights but fails."""
    server = on_a
    (_, ma), (_, mb) = models["a"], models["b"]
    t, box = running(server, "held")
    assert server.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    try:
        refused = update_to_b(server, models, flush=True)
        assert refused.status_code == 400 and refused.json() == {"success": False, "message": FLUSH_FAILED,
                                                                 "num_paused_requests": 1}
        assert server.weight_version() == "11"  # loaded all the same, as SGLang does
        ok = update_to_b(server, models, flush=False)
        assert ok.json()["success"] and ok.json()["num_paused_requests"] == 1
        assert server.load()["num_running_reqs"] == 1  # held in place, with its KV
    finally:
        server.post("/continue_generation", {})
    t.join(120)
    ids, lps, k = split(box["final"])
    assert 5 <= k < N
    seq = PROMPT + ids
    mixed = decode_over_cache(ma, mb, seq, len(PROMPT) + k - 1)[len(PROMPT) - 1:]
    assert torch.allclose(lps, mixed, atol=1e-4)
    recomputed_b = teacher_forced(mb, seq)[len(PROMPT) - 1:]
    assert not torch.allclose(lps[k:k + 4], recomputed_b[k:k + 4], atol=1e-3)  # the KV really was a's
    assert server.post("/flush_cache").status_code == 200


def test_retract_update_flushes_and_recomputes(on_a, models):
    """Paused with retract, a flushing update succeeds and the request is prefilled again: exactly b's log-probs."""
    server = on_a
    (_, ma), (_, mb) = models["a"], models["b"]
    t, box = running(server, "retracted")
    assert server.post("/pause_generation", {"mode": "retract"}).json()["status"] == "ok"
    try:
        load = server.load()
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1)
        r = update_to_b(server, models, flush=True)
        assert r.json()["success"] and r.json()["num_paused_requests"] == 1, r.text
    finally:
        server.post("/continue_generation", {})
    t.join(120)
    ids, lps, k = split(box["final"])
    seq = PROMPT + ids
    assert torch.allclose(lps[:k], teacher_forced(ma, seq)[len(PROMPT) - 1:][:k], atol=1e-4)
    assert torch.allclose(lps[k:], teacher_forced(mb, seq)[len(PROMPT) - 1:][k:], atol=1e-4)


def test_prefix_cache_is_never_reused_across_versions_by_a_versioned_key(on_a, models):
    """An aborted request's KV (model a, key "w10") survives an update with flush_cache=false."""
    server = on_a
    (_, mb) = models["b"]
    t, box = running(server, "to-park", ready_at=8, extra_key="w10")
    server.post("/abort_request", {"rid": "to-park"})
    t.join(60)
    part = box["final"]["output_ids"]
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort" and len(part) >= 8
    assert update_to_b(server, models, flush=False).json()["success"]
    stale0 = server.stats()["cache_stale_hits"]
    resume = {"input_ids": PROMPT + part, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}

    fresh = server.post("/generate", {**resume, "extra_key": "w11"}).json()
    assert fresh["meta_info"]["cached_tokens"] == 0 and server.stats()["cache_stale_hits"] == stale0
    seq = PROMPT + part + fresh["output_ids"]
    want = teacher_forced(mb, seq)[len(PROMPT + part) - 1:]
    got = torch.tensor([lp for lp, _, _ in fresh["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, want, atol=1e-4)

    stale = server.post("/generate", {**resume, "extra_key": "w10"}).json()  # the entry is still there, under w10
    assert stale["meta_info"]["cached_tokens"] == len(PROMPT + part) - 1
    assert server.stats()["cache_stale_hits"] == stale0 + 1
    got_stale = torch.tensor([lp for lp, _, _ in stale["meta_info"]["output_token_logprobs"]])
    assert not torch.allclose(got_stale[:1], got[:1], atol=1e-3)  # a's KV under b's weights: not b's log-probs


def test_update_weight_version_aborts_unless_told_not_to(on_a):
    """SGLang's /update_weight_version."""
    server = on_a
    t, box = running(server, "kept", n=120)
    r = server.post("/update_weight_version", {"new_version": "11", "abort_all_requests": False}).json()
    assert r == {"success": True, "message": "Weight version updated to 11", "new_version": "11"}
    t.join(120)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "length"
    split(box["final"])
    t, box = running(server, "aborted", n=200)
    assert server.post("/update_weight_version", {"new_version": "12"}).json()["success"]
    t.join(60)
    assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert box["final"]["meta_info"]["weight_versions"] == [{"version": "11", "start": 0,
                                                            "end": len(box["final"]["output_ids"])}]


# ---- the pause modes themselves (SGLang's /pause_generation), one model -------------------------------------
def _held_request(server, prompt, sp):
    """A request sent while the engine is paused."""
    box = {}
    t = threading.Thread(target=lambda: box.update(gen(server, prompt, sampling_params=sp)))
    t.start()
    return t, box


def test_pause_in_place_holds_rows_and_new_requests(server):
    """SGLang's in_place: the row is held with its KV, a flush refused, a new request held until the continue."""
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    t, box = _running_stream(server, "run-1", [1, 2, 3], sp)
    assert server.post("/pause_generation", {"mode": "in_place"}).json()["status"] == "ok"
    try:
        load1 = server.load()
        time.sleep(0.3)
        load2 = server.load()
        assert load1["num_running_reqs"] == 1 and load1["num_used_tokens"] == load2["num_used_tokens"]  # nothing decodes
        refused = server.post("/flush_cache")
        assert refused.status_code == 400 and "1 requests are running" in refused.text  # a row is held in place
        w, waiting = _held_request(server, [1, 4], {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        time.sleep(0.3)
        assert server.load()["num_waiting_reqs"] == 0 and w.is_alive()  # held before the scheduler
        assert server.post("/abort_request", {"abort_all": True}).status_code == 200
        t.join(60)  # the held row ends with its tokens; the held request is not reached
        assert not t.is_alive() and box["final"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(box["final"]["output_ids"]) >= 2 and w.is_alive()
    finally:
        assert server.post("/continue_generation", {}).json()["status"] == "ok"
    w.join(60)
    assert waiting["meta_info"]["finish_reason"]["type"] == "length" and len(waiting["output_ids"]) == 3
    assert server.post("/flush_cache").status_code == 200


def test_pause_in_place_then_continue_completes(server):
    prompt, n = [1, 6, 6], 60
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    full = gen(server, prompt, sampling_params=sp)["output_ids"]
    t, box = _running_stream(server, None, prompt, sp)
    server.post("/pause_generation", {"mode": "in_place"})
    time.sleep(0.2)
    assert server.post("/continue_generation", {}).status_code == 200
    t.join(30)
    assert box["final"]["output_ids"] == full and box["final"]["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_frees_rows_allows_a_flush_and_recomputes(server):
    """SGLang's retract: requests requeued with KV freed, a flush allowed, then prefilled again as if never paused."""
    prompt, n = [1, 8, 6, 7], 200  # long enough that the pause lands before the request ends
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    full = gen(server, prompt, sampling_params=sp)["output_ids"]
    retracted0 = server.stats()["retractions"]
    t, box = _running_stream(server, "retract-1", prompt, sp, min_tokens=3)
    assert server.post("/pause_generation", {"mode": "retract"}).json()["status"] == "ok"
    try:
        load = server.load()
        assert (load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"]) == (0, 1, 0)
        assert server.post("/flush_cache").status_code == 200  # paused: the waiting request does not count
    finally:
        server.post("/continue_generation", {})
    t.join(60)
    assert box["final"]["output_ids"] == full and box["final"]["meta_info"]["finish_reason"]["type"] == "length"
    assert server.stats()["retractions"] == retracted0 + 1


def test_pause_abort_mode(server):
    """SGLang's abort: every request is aborted, the scheduler keeps running, new requests are held until the continue."""
    sp = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    t, box = _running_stream(server, None, [1, 2], sp)
    assert server.post("/pause_generation", {"mode": "abort"}).json()["status"] == "ok"
    try:
        t.join(10)
        assert box["final"]["meta_info"]["finish_reason"]["type"] == "abort"
        w, held = _held_request(server, [1, 5], {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
        time.sleep(0.3)
        assert w.is_alive() and server.load()["num_waiting_reqs"] == 0
    finally:
        server.post("/continue_generation", {})
    w.join(60)
    assert held["meta_info"]["completion_tokens"] == 2
