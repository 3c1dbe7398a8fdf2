"""What a paused engine must compute, for the pause tests on the embedded engine and on SGLang's own server
(test_hf_engine_pause.py, test_real_sglang.py): the log-probs of a request held in place across an update (the
new weights over the old weights' KV) or recomputed (the new weights throughout), and the streaming helpers that
catch a request mid-way."""

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
