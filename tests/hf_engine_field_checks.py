"""One check per SGLang request field the embedded engine honours (tests/test_hf_engine_schema.py runs them against
the engine and a reference forward of the same tiny model), and the requests they send."""

from __future__ import annotations

import json
import re

import pytest
import requests
import torch

from hf_engine_reference import greedy_reference

PROMPT = [1, 5, 6, 7, 14]
BOS, EOS = 1, 2


def post(server, body) -> requests.Response:
    data = body if isinstance(body, str) else json.dumps(body)  # a str: sent as it is (not JSON, say)
    return requests.post(server.url + "/generate", data=data, headers={"Content-Type": "application/json"}, timeout=60)


def gen(server, ids=PROMPT, **body) -> dict:
    r = post(server, {"input_ids": ids, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(server, body, name) -> None:
    r = post(server, body)
    assert r.status_code == 400, (name, r.text)
    assert name in r.json()["error"]["message"], r.text


def logits_of(ref, seq) -> torch.Tensor:
    with torch.no_grad():
        return ref[0](torch.tensor([seq])).logits[0].float()


def greedy(server, n=12, ids=PROMPT, **sp) -> dict:
    return gen(server, ids, return_logprob=True, sampling_params={"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sp})


def out_lps(out) -> list[float]:
    return [row[0] for row in out["meta_info"]["output_token_logprobs"]]


def step_logp(ref, prompt, out_ids, temperature=1.0) -> torch.Tensor:
    """log_softmax(logits / T) at each output position: [len(out_ids), V]."""
    lg = logits_of(ref, prompt + out_ids)[len(prompt) - 1: len(prompt) + len(out_ids) - 1]
    return torch.log_softmax(lg / temperature, -1)


# ---- honoured top-level fields --------------------------------------------------------------------------
def check_rid(server, ref):
    assert gen(server, rid="schema-rid", sampling_params={"max_new_tokens": 1})["meta_info"]["id"] == "schema-rid"


def check_text(server, ref):
    text = "ab 3 cde"
    ids = ref[1].encode(text)
    a = gen(server, None, text=text, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert a["meta_info"]["prompt_tokens"] == len(ids) == 3
    assert a["output_ids"] == gen(server, ids, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
    refused(server, {"input_ids": ids, "text": text}, "text")


def check_input_ids(server, ref):
    assert greedy(server, 8)["output_ids"] == greedy_reference(ref[0], PROMPT, 8)


def check_sampling_params(server, ref):
    batch = gen(server, [PROMPT, PROMPT[:3]], sampling_params=[{"max_new_tokens": 2, "ignore_eos": True},
                                                              {"max_new_tokens": 3, "ignore_eos": True}])
    assert [o["meta_info"]["completion_tokens"] for o in batch] == [2, 3]


def check_return_logprob(server, ref):
    assert "output_token_logprobs" not in gen(server, sampling_params={"max_new_tokens": 2})["meta_info"]
    out = gen(server, return_logprob=True, sampling_params={"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1})
    want = step_logp(ref, PROMPT, out["output_ids"]).gather(1, torch.tensor(out["output_ids"])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out_lps(out)), want, atol=1e-4)


def _prompt_ref(ref, ids):
    return torch.log_softmax(logits_of(ref, ids)[:-1], -1)  # row p predicts token p + 1


def check_logprob_start_len(server, ref):
    lp = _prompt_ref(ref, PROMPT)
    for start in (0, 2):
        meta = gen(server, return_logprob=True, logprob_start_len=start, sampling_params={"max_new_tokens": 0})["meta_info"]
        rows = meta["input_token_logprobs"]
        assert [t for _, t, _ in rows] == PROMPT[start:] and meta["completion_tokens"] == 0
        want = [None if i == 0 else lp[i - 1, PROMPT[i]].item() for i in range(start, len(PROMPT))]
        assert (rows[0][0] is None) == (start == 0)  # position 0 has no context: null, as in SGLang
        assert [x for x, _, _ in rows if x is not None] == pytest.approx([w for w in want if w is not None], abs=1e-4)
    assert gen(server, return_logprob=True, sampling_params={"max_new_tokens": 1})["meta_info"]["input_token_logprobs"] == []
    refused(server, {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT)}, "logprob_start_len")
    refused(server, {"input_ids": PROMPT, "logprob_start_len": 0}, "logprob_start_len")  # without return_logprob


def check_top_logprobs_num(server, ref):
    out = gen(server, return_logprob=True, top_logprobs_num=3, logprob_start_len=0,
              sampling_params={"max_new_tokens": 6, "temperature": 0.8, "sampling_seed": 2, "ignore_eos": True})
    logp = step_logp(ref, PROMPT, out["output_ids"], 0.8)
    for row, top in zip(logp, out["meta_info"]["output_top_logprobs"]):
        vals, ids = row.topk(3)
        assert [t for _, t, _ in top] == ids.tolist() and [v for v, _, _ in top] == pytest.approx(vals.tolist(), abs=1e-4)
    prompt_top = out["meta_info"]["input_top_logprobs"]
    assert prompt_top[0] is None and len(prompt_top) == len(PROMPT)
    plp = torch.log_softmax(logits_of(ref, PROMPT)[:-1] / 0.8, -1)  # prompt log-probs use the request's T too
    assert [t for _, t, _ in prompt_top[2]] == plp[1].topk(3).indices.tolist()


def check_token_ids_logprob(server, ref):
    want_ids = [3, 13, EOS]
    out = gen(server, return_logprob=True, token_ids_logprob=want_ids, logprob_start_len=1,
              sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    logp = step_logp(ref, PROMPT, out["output_ids"])
    for row, got in zip(logp, out["meta_info"]["output_token_ids_logprobs"]):
        assert [t for _, t, _ in got] == want_ids and [v for v, _, _ in got] == pytest.approx(row[want_ids].tolist(), abs=1e-4)
    plp = _prompt_ref(ref, PROMPT)
    first = out["meta_info"]["input_token_ids_logprobs"][0]  # position 1
    assert [v for v, _, _ in first] == pytest.approx(plp[0, want_ids].tolist(), abs=1e-4)


def check_return_text_in_logprobs(server, ref):
    out = gen(server, return_logprob=True, return_text_in_logprobs=True, sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert [x for _, _, x in out["meta_info"]["output_token_logprobs"]] == [ref[1].decode([t]) for t in out["output_ids"]]


def check_stream(server, ref):
    """Server-sent events, each chunk the reply so far (cumulative, as SGLang's), [DONE] last."""
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln.decode() for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 5
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 5


def check_routed_dp_rank(server, ref, name="routed_dp_rank"):
    assert gen(server, **{name: 0}, sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    refused(server, {"input_ids": PROMPT, name: 1}, name)


def check_extra_key(server, ref):
    """The prefix cache's namespace: an aborted request's KV is reused only by a request with the same extra_key."""
    for attempt in range(3):  # (a loaded box may stream in larger chunks, or let the request end before the abort)
        body = {"input_ids": PROMPT, "rid": f"keyed-{attempt}", "stream": True, "extra_key": "k1",
                "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
        final, aborted = None, False
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
            for ln in r.iter_lines():
                if ln and ln != b"data: [DONE]":
                    final = json.loads(ln[len(b"data: "):])
                    if len(final["output_ids"]) >= 3 and not aborted:
                        requests.post(server.url + "/abort_request", json={"rid": body["rid"]}, timeout=10)
                        aborted = True
        if final["meta_info"]["finish_reason"]["type"] == "abort":
            break
    seq = PROMPT + final["output_ids"]
    resume = {"sampling_params": {"max_new_tokens": 1}}
    assert gen(server, seq, extra_key="k2", **resume)["meta_info"]["cached_tokens"] == 0  # another namespace
    assert gen(server, seq, **resume)["meta_info"]["cached_tokens"] == 0  # none is a namespace too
    assert gen(server, seq, extra_key="k1", **resume)["meta_info"]["cached_tokens"] == len(seq) - 1
    refused(server, {"input_ids": PROMPT, "extra_key": 3}, "extra_key")


# ---- honoured sampling params ---------------------------------------------------------------------------
def check_max_new_tokens(server, ref):
    assert greedy(server, 5)["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    zero = gen(server, sampling_params={"max_new_tokens": 0})
    assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def _free_run(server, ref, n=40):
    free = greedy(server, n)["output_ids"]
    return free, [ref[1].decode(free[: k + 1], skip_special_tokens=False) for k in range(n)]


def check_stop(server, ref):
    """A stop string that ends inside a multi-character token still stops (SGLang: `stop in text`)."""
    free, texts = _free_run(server, ref)
    for j in range(1, len(free)):
        word = ref[1].decode([free[j]])
        stop = word[:-1]
        if len(word) >= 2 and stop not in texts[j - 1]:
            break
    else:
        pytest.fail(f"no multi-character token to stop inside in {texts[-1]!r}")
    for trim in (False, True):
        out = gen(server, sampling_params={"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": [stop],
                                           "no_stop_trim": trim, "skip_special_tokens": False})
        assert out["output_ids"] == free[: j + 1] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        pos = texts[j].find(stop)
        assert out["text"] == (texts[j][: pos + len(stop)] if trim else texts[j][:pos])


def check_stop_token_ids(server, ref):
    free, texts = _free_run(server, ref, 12)
    k = next(i for i in range(2, 12) if free[i] not in free[:i] and EOS not in free[: i + 1])
    for trim in (False, True):
        out = gen(server, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [free[k]],
                                           "no_stop_trim": trim, "skip_special_tokens": False})
        assert out["output_ids"] == free[: k + 1] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": free[k]}
        assert out["text"] == (texts[k] if trim else texts[k - 1])  # the stop token's text is trimmed, as SGLang does
    # as in SGLang, ignore_eos also turns stop_token_ids off
    out = gen(server, sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [free[k]],
                                       "ignore_eos": True})
    assert out["output_ids"] == free and out["meta_info"]["finish_reason"]["type"] == "length"


def check_stop_regex(server, ref):
    free, texts = _free_run(server, ref, 12)
    pattern = re.escape(texts[3][-2:]) + "|[a-z]{9}"
    k = next(i for i in range(12) if re.search(pattern, texts[i]))
    out = gen(server, sampling_params={"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop_regex": pattern,
                                       "skip_special_tokens": False})
    assert out["output_ids"] == free[: k + 1] and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    refused(server, {"input_ids": PROMPT, "sampling_params": {"stop_regex": "(unclosed"}}, "stop_regex")


def check_temperature(server, ref):
    tiny = gen(server, return_logprob=True, sampling_params={"max_new_tokens": 8, "temperature": 1e-30, "ignore_eos": True})
    zero = greedy(server, 8)
    assert tiny["output_ids"] == zero["output_ids"] and out_lps(tiny) == pytest.approx(out_lps(zero), abs=1e-6)
    assert all(isinstance(x, float) for x in out_lps(tiny))  # never a null log-prob
    hot = gen(server, return_logprob=True, sampling_params={"max_new_tokens": 8, "temperature": 2.0, "sampling_seed": 4})
    want = step_logp(ref, PROMPT, hot["output_ids"], 2.0).gather(1, torch.tensor(hot["output_ids"])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(out_lps(hot)), want, atol=1e-4)
    refused(server, {"input_ids": PROMPT, "sampling_params": {"temperature": -0.5}}, "temperature")


def _allowed_check(server, ref, sp, allowed):
    out = gen(server, sampling_params={"max_new_tokens": 30, "temperature": 1.5, "ignore_eos": True, "sampling_seed": 5, **sp})
    probs = step_logp(ref, PROMPT, out["output_ids"], 1.5).exp()
    assert all(bool(allowed(row)[t]) for row, t in zip(probs, out["output_ids"])), sp


def check_top_k(server, ref):
    _allowed_check(server, ref, {"top_k": 2}, lambda p: p >= p.topk(2).values[-1])


def check_top_p(server, ref):
    def nucleus(p):
        s, order = p.sort(descending=True)
        keep = (s.cumsum(0) - s) < 0.3
        return torch.zeros_like(p, dtype=torch.bool).scatter(0, order, keep)

    _allowed_check(server, ref, {"top_p": 0.3}, nucleus)


def check_min_p(server, ref):
    _allowed_check(server, ref, {"min_p": 0.7}, lambda p: p >= 0.7 * p.max() - 1e-6)


def check_ignore_eos(server, ref):
    sp = {"max_new_tokens": 4, "temperature": 1.0, "logit_bias": {str(EOS): 100.0}}
    assert gen(server, sampling_params=sp)["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    out = gen(server, sampling_params={**sp, "ignore_eos": True})
    assert out["output_ids"] == [EOS] * 4 and out["meta_info"]["finish_reason"]["type"] == "length"


def check_logit_bias(server, ref):
    out = gen(server, return_logprob=True, sampling_params={"max_new_tokens": 3, "logit_bias": {"7": 100.0}, "sampling_seed": 0})
    assert out["output_ids"] == [7, 7, 7] and all(abs(x) < 1e-3 for x in out_lps(out))  # the bias is in the log-probs
    refused(server, {"input_ids": PROMPT, "sampling_params": {"logit_bias": {"99999": 1.0}}}, "logit_bias")


def check_skip_special_tokens(server, ref):
    sp = {"max_new_tokens": 3, "logit_bias": {str(BOS): 100.0}, "ignore_eos": True}
    assert gen(server, sampling_params=sp)["text"] == ""
    assert gen(server, sampling_params={**sp, "skip_special_tokens": False})["text"] == "<bos>" * 3


def check_spaces_between_special_tokens(server, ref):
    """Passed to the tokenizer's decode as SGLang passes it (a no-op for fast tokenizers)."""
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
    for v in (True, False):
        out = gen(server, sampling_params={**sp, "spaces_between_special_tokens": v})
        assert out["text"] == ref[1].decode(out["output_ids"], skip_special_tokens=False, spaces_between_special_tokens=v)
    refused(server, {"input_ids": PROMPT, "sampling_params": {"spaces_between_special_tokens": "no"}}, "spaces_between_special_tokens")


def check_no_stop_trim(server, ref):
    check_stop_token_ids(server, ref)  # both values of no_stop_trim are checked there and in check_stop


def check_stream_interval(server, ref):
    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "stream_interval": 3}}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln and ln != b"data: [DONE]"]
    sizes = [len(c["output_ids"]) for c in chunks]
    assert sizes[-1] == 10 and all(s % 3 == 0 for s in sizes[:-1]) and len(sizes) <= 4, sizes


def check_sampling_seed(server, ref):
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    a, b, c = (gen(server, sampling_params={**sp, "sampling_seed": s})["output_ids"] for s in (9, 9, 10))
    assert a == b != c


def check_n(server, ref):
    assert gen(server, sampling_params={"max_new_tokens": 1, "n": 1})["meta_info"]["completion_tokens"] == 1
    refused(server, {"input_ids": PROMPT, "sampling_params": {"n": 2}}, "sampling_params.n")


HONOURED_CHECKS = {
    "rid": check_rid, "text": check_text, "input_ids": check_input_ids, "sampling_params": check_sampling_params,
    "return_logprob": check_return_logprob, "logprob_start_len": check_logprob_start_len,
    "top_logprobs_num": check_top_logprobs_num, "token_ids_logprob": check_token_ids_logprob,
    "return_text_in_logprobs": check_return_text_in_logprobs, "stream": check_stream,
    "routed_dp_rank": check_routed_dp_rank, "extra_key": check_extra_key,
    "data_parallel_rank": lambda s, r: check_routed_dp_rank(s, r, "data_parallel_rank"),
    "sampling_params.max_new_tokens": check_max_new_tokens, "sampling_params.stop": check_stop,
    "sampling_params.stop_token_ids": check_stop_token_ids, "sampling_params.stop_regex": check_stop_regex,
    "sampling_params.temperature": check_temperature, "sampling_params.top_p": check_top_p,
    "sampling_params.top_k": check_top_k, "sampling_params.min_p": check_min_p,
    "sampling_params.ignore_eos": check_ignore_eos, "sampling_params.skip_special_tokens": check_skip_special_tokens,
    "sampling_params.spaces_between_special_tokens": check_spaces_between_special_tokens,
    "sampling_params.no_stop_trim": check_no_stop_trim, "sampling_params.stream_interval": check_stream_interval,
    "sampling_params.logit_bias": check_logit_bias, "sampling_params.sampling_seed": check_sampling_seed,
    "sampling_params.n": check_n,
}
