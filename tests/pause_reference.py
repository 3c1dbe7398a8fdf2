"""What a paused engine must compute, for the pause tests on the embedded engine and on SGLang's own server
(test_hf_engine_pause.py, test_async_rollout.py, test_real_sglang.py): the log-probs of a request held in place
across an update (the new weights over the old weights' KV) or recomputed (the new weights throughout), the
streaming helpers that catch a request mid-way, the pause and cache-key scenarios both engines must answer alike,
and `ReplyLog` (which tokens a request sampled under weights newer than the ones it was sent at)."""

from __future__ import annotations

import json
import threading

import requests
import torch
from transformers import DynamicCache


@torch.no_grad()
def decode_over_cache(ma, mb, ids: list[int], boundary: int) -> torch.Tensor:
    """Log-probs of ids[p + 1] for each position p, with positions < boundary computed by `ma` and the rest by `mb`,
    all in one KV cache: what a request held in place across an update computes."""
    cache = DynamicCache()
    out = []
    for p, tok in enumerate(ids[:-1]):
        model = ma if p < boundary else mb
        logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits[0, -1]
        out.append(torch.log_softmax(logits.float(), -1)[ids[p + 1]])
    return torch.stack(out)


@torch.no_grad()
def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """Log-probs of ids[p + 1] for each position p under `model` (recomputed: one forward)."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def stream(url: str, body: dict, box: dict, ready_at: int) -> None:
    """Stream `body` (SGLang's cumulative chunks); box['ready'] is set once `ready_at` tokens came back,
    box['final'] is the last chunk."""
    with requests.post(url + "/generate", json={**body, "stream": True}, stream=True, timeout=600) as r:
        for ln in r.iter_lines():
            if not ln or ln == b"data: [DONE]":
                continue
            chunk = json.loads(ln[len(b"data: "):])
            if len(chunk["output_ids"]) >= ready_at:
                box["ready"].set()
            box["final"] = chunk


def running(url: str, prompt: list[int], rid: str, n: int, ready_at: int, extra_key: str | None = None,
            timeout: float = 300.0):
    """A greedy request streaming on the engine at `url` with at least `ready_at` tokens: (thread, box)."""
    body = {"input_ids": prompt, "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if extra_key is not None:
        body["extra_key"] = extra_key
    box = {"ready": threading.Event()}
    t = threading.Thread(target=stream, args=(url, body, box, ready_at))
    t.start()
    assert box["ready"].wait(timeout), f"{url}: no {ready_at} tokens in {timeout:.0f}s"
    return t, box


def split(final: dict, old: str, new: str) -> tuple[list[int], torch.Tensor, int]:
    """(output ids, their log-probs, k) of a reply whose spans are `old` for [0, k) and `new` for [k, n)."""
    meta = final["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == [old, new] and meta["weight_version"] == new, spans
    k = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1]["start"] == k and spans[1]["end"] == len(final["output_ids"])
    lps = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    return final["output_ids"], lps, k


def generate(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


class ReplyLog:
    """Every reply's segment, by sample: (tokens before it, its versions, the version it was sent at), to tell which
    tokens a request sampled under weights newer than the ones it was sent at (--pause-mode in_place: those may
    attend to KV of the older weights: the request's own, or a cached prefix under its version's key)."""

    def __init__(self, monkeypatch):
        from slime.rollout.sampling_request import SampleRequester

        self.by_sample: dict[int, list[tuple[int, list[int], int]]] = {}
        original = SampleRequester.request

        async def request(requester, payload, window, sample):
            before = sample.response_length
            sent = window.sent if window is not None else requester.policy_version
            seg = await original(requester, payload, window, sample)
            versions = seg.versions if isinstance(seg.versions, list) else [seg.versions] * len(seg.ids)
            self.by_sample.setdefault(sample.index, []).append((before, versions, sent))
            return seg

        monkeypatch.setattr(SampleRequester, "request", request)

    def crossed(self, sample, overlap: bool = False) -> set[int]:
        """Positions of `sample`'s response sampled under weights newer than its request was sent at (a restart
        resets the response: only positions of its current one count); `overlap`: also the one before each such run,
        the token SGLang's overlap scheduler may have had in flight at the pause (either weights may have sampled
        it; our label says the older: engine_versions.lag_spans)."""
        out = set()
        for before, versions, sent in self.by_sample.get(sample.index, []):
            for i, v in enumerate(versions):
                newer = v != sent or (overlap and i + 1 < len(versions) and versions[i + 1] != sent)
                if newer and before + i < sample.response_length:
                    out.add(before + i)
        return out


def pause_scenario(url: str, dirs: dict, models: dict, prompt: list[int]) -> dict:
    """Pauses around disk updates on one engine, each checked against the models: in_place holds a running request
    with its KV (an update that flushes is refused after loading; without the flush it goes through; the request
    then samples model B over model A's KV), retract frees it and prefills it again (B from the update on), abort
    aborts it and holds a new request until the continue. Returns what both engines must answer alike."""
    def update(name: str, version: str, flush: bool) -> requests.Response:
        return requests.post(url + "/update_weights_from_disk", json={"model_path": dirs[name], "weight_version": version,
                                                                   "flush_cache": flush}, timeout=300)

    def post(path: str, body=None) -> requests.Response:
        return requests.post(url + path, json=body or {}, timeout=300)

    def paused(rid: str, mode: str, old: str, during) -> dict:
        """`rid` runs on model A (version `old`), is paused (`mode`) for `during()` and continued: its final reply.
        Run again when the request ended before the pause landed (a loaded box): its reply then has one span."""
        for _ in range(3):
            assert update("A", old, True).json()["success"]
            t, box = running(url, prompt, rid, n, 3)
            post("/pause_generation", {"mode": mode})
            during()
            post("/continue_generation")
            t.join(600)
            if len(box["final"]["meta_info"]["weight_versions"]) > 1:
                break
        return box["final"]

    def in_place_updates() -> None:
        refused = update("B", "31", True)
        out["in_place_update_with_flush"] = (refused.status_code, refused.json()["success"], refused.json()["message"])
        out["in_place_loaded_anyway"] = requests.get(url + "/model_info", timeout=30).json()["weight_version"]
        out["in_place_update"] = update("B", "31", False).json()["success"]
        out["in_place_flush"] = post("/flush_cache").status_code

    def retract_updates() -> None:
        out["retract_update"] = update("B", "33", True).json()["success"]
        out["retract_flush"] = post("/flush_cache").status_code

    out = {}
    (ma, mb), n = (models["A"], models["B"]), 200  # long enough to be running when the pause lands (streams lag)
    final = paused("pause-in-place", "in_place", "30", in_place_updates)
    ids, lps, k = split(final, "30", "31")
    seq = prompt + ids
    # the first token model B sampled: the spans' boundary, or (SGLang: its overlap scheduler appends the token in
    # flight at the pause after the resume) one later
    first_b = [b for b in range(k - 1, k + 3)
               if torch.allclose(lps, decode_over_cache(ma, mb, seq, len(prompt) + b - 1)[len(prompt) - 1:], atol=1e-4)]
    assert 3 <= k < n and len(first_b) == 1, (k, first_b, lps)
    out["in_place_old_tokens_past_the_boundary"] = first_b[0] - k
    out["in_place_spans"] = len(final["meta_info"]["weight_versions"])

    final = paused("pause-retract", "retract", "32", retract_updates)
    ids, lps, k = split(final, "32", "33")
    seq = prompt + ids
    assert torch.allclose(lps[:k], teacher_forced(ma, seq)[len(prompt) - 1:][:k], atol=1e-4)
    assert torch.allclose(lps[k:], teacher_forced(mb, seq)[len(prompt) - 1:][k:], atol=1e-4)
    out["retract_num_retractions"] = final["meta_info"]["num_retractions"]

    for _ in range(3):
        t, box = running(url, prompt, "pause-abort", n, 3)
        post("/pause_generation", {"mode": "abort"})
        t.join(600)
        if len(box["final"]["output_ids"]) < n:  # (else it ended before the pause landed: again)
            break
        post("/continue_generation")
    out["abort_finish"] = box["final"]["meta_info"]["finish_reason"]
    held = {}
    h = threading.Thread(target=lambda: held.update(generate(url, {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})))
    h.start()
    h.join(2)
    out["abort_holds_new_requests"] = h.is_alive()
    post("/continue_generation")
    h.join(600)
    out["held_request_tokens"] = len(held["output_ids"])
    return out


def cache_key_scenario(url: str, dirs: dict, models: dict, prompt: list[int]) -> dict:
    """An aborted request's KV, kept across an update that keeps the cache, under our client's version keys: a
    request keyed by the new version is prefilled by the new weights; keyed by the old one it reuses the old KV."""
    requests.post(url + "/update_weights_from_disk", json={"model_path": dirs["A"], "weight_version": "40"}, timeout=300)
    t, box = running(url, prompt, "to-park", 60, 8, extra_key="weights-v40")
    requests.post(url + "/abort_request", json={"rid": "to-park"}, timeout=30)
    t.join(600)
    part = box["final"]["output_ids"]
    assert requests.post(url + "/update_weights_from_disk", json={"model_path": dirs["B"], "weight_version": "41",
                                                                 "flush_cache": False}, timeout=300).json()["success"]
    resume = {"input_ids": prompt + part, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    fresh = generate(url, {**resume, "extra_key": "weights-v41"})
    seq = prompt + part + fresh["output_ids"]
    got = torch.tensor([lp for lp, _, _ in fresh["meta_info"]["output_token_logprobs"]])
    assert torch.allclose(got, teacher_forced(models["B"], seq)[len(prompt + part) - 1:], atol=1e-4)
    stale = generate(url, {**resume, "extra_key": "weights-v40"})
    got_stale = torch.tensor([lp for lp, _, _ in stale["meta_info"]["output_token_logprobs"]])
    return {"new_key_cached": fresh["meta_info"]["cached_tokens"], "old_key_cached": stale["meta_info"]["cached_tokens"] > 0,
            "old_key_is_old_kv": not torch.allclose(got_stale[:1], got[:1], atol=1e-3), "aborted_at": len(part) >= 8}
