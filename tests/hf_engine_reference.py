"""The engine tests' reference (greedy tokens and teacher-forced log-probs from a plain transformers model) and
their requests to a running embedded engine."""

from __future__ import annotations

import json
import threading
import time

import requests
import torch

from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

WORDS = [str(i) for i in range(10)] + list("abcdefghijklmnopqrstuvwxyz")


def tiny_spec(max_positions: int = 256) -> TinyQwen3Spec:
    """The engine tests' tiny Qwen3: 2 layers, hidden 64, 4 heads over 2 KV heads."""
    return TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=max_positions)


def tiny_model(tmp_path_factory, name: str, seed: int, words=WORDS, spec: TinyQwen3Spec | None = None):
    """A random tiny Qwen3 saved in a fresh folder `name` (one torch thread): (the folder, the model, eval mode)."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp(name)
    return d, build_tiny_qwen3(str(d), build_tokenizer(words), spec or tiny_spec(), seed=seed).eval()


def load_model(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

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
