"""The engine tests' reference (greedy tokens and teacher-forced log-probs from a plain transformers model) and
their requests to a running embedded engine."""

from __future__ import annotations

import json
import threading
import time

import requests
import torch

def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from a plain transformers model, one full forward per token (no cache): the reference."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def gen(server, ids, timeout=60, **kw) -> dict:
    body = {"input_ids": ids, "return_logprob": True, **kw}
    r = server.post("/generate", body, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def teacher_forced_logprobs(model, prompt, output, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    steps = logits[len(prompt) - 1: len(prompt) + len(output) - 1]
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(steps / t, dim=-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


def _stream_until(server, body, min_tokens, box):
    """Stream a request; after `min_tokens` tokens set box['ready']; store the final chunk in box['final']."""
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=60) as r:
        for ln in r.iter_lines():
            if not ln or ln == b"data: [DONE]":
                continue
            chunk = json.loads(ln[len(b"data: "):])
            if len(chunk["output_ids"]) >= min_tokens:
                box["ready"].set()
            box["final"] = chunk


def _wait_idle(server, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = server.load()
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return True
        time.sleep(0.05)
    return False


def _wait_load(server, key, value, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.load()[key] == value:
            return True
        time.sleep(0.05)
    return False


def _running_stream(server, rid, prompt, sp, min_tokens=2):
    """A streamed request of ours running on the engine with at least `min_tokens` tokens: (thread, box)."""
    box = {"ready": threading.Event()}
    t = threading.Thread(target=_stream_until, args=(server, {"input_ids": prompt, "rid": rid, "sampling_params": sp},
                                                     min_tokens, box))
    t.start()
    assert box["ready"].wait(30)
    return t, box
