"""Validation of SGLang /generate bodies and building of SGLang-shaped responses."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from slime.backends.hf_engine.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128
# SGLang sampling knobs we do not implement: accepted only at their neutral value.
UNSUPPORTED_NEUTRAL = {"min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                       "json_schema": None, "regex": None, "ebnf": None}


class BadRequest(ValueError):
    """Client error; the message names the offending field."""


@dataclass
class GenerateInput:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    stream: bool
    token_text: bool = False


def _num(sp: dict, key: str, kind, default, lo=None, hi=None, lo_open=False):
    v = sp.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"sampling_params.{key}: expected {kind.__name__}, got {v!r}")
    v = kind(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(f"sampling_params.{key}: must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and v > hi:
        raise BadRequest(f"sampling_params.{key}: must be <= {hi}, got {v}")
    return v


def parse_sampling_params(sp, prompt_len: int, max_positions: int) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params: expected an object")
    n = sp.get("n", 1)
    if n not in (None, 1):
        raise BadRequest(f"sampling_params.n: only n=1 is supported, got {n!r}")
    for key, neutral in UNSUPPORTED_NEUTRAL.items():
        if sp.get(key) not in (None, neutral):
            raise BadRequest(f"sampling_params.{key}: not supported by the embedded engine (only {neutral!r})")
    room = max_positions - prompt_len
    if "max_new_tokens" in sp and sp["max_new_tokens"] is not None:
        max_new = _num(sp, "max_new_tokens", int, None, lo=0, lo_open=True)
        if max_new > room:
            raise BadRequest(
                f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) exceeds the model's "
                f"max positions ({max_positions})"
            )
    else:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
        if max_new <= 0:
            raise BadRequest(f"input_ids: prompt of {prompt_len} tokens leaves no room under max positions {max_positions}")
    stop_ids = sp.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("sampling_params.stop_token_ids: expected a list of ints")
    stop = sp.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("sampling_params.stop: expected a string or a list of strings")
    seed = sp.get("sampling_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"sampling_params.sampling_seed: expected int, got {seed!r}")
    top_k = _num(sp, "top_k", int, -1)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"sampling_params.top_k: must be -1 (off) or >= 1, got {top_k}")
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=_num(sp, "temperature", float, 1.0, lo=0.0),
        top_p=_num(sp, "top_p", float, 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=top_k,
        min_p=_num(sp, "min_p", float, 0.0, lo=0.0, hi=1.0),
        stop_token_ids=list(stop_ids),
        stop=list(stop),
        ignore_eos=bool(sp.get("ignore_eos", False)),
        skip_special_tokens=bool(sp.get("skip_special_tokens", True)),
        no_stop_trim=bool(sp.get("no_stop_trim", False)),
        sampling_seed=seed,
    )


def _check_ids(ids, vocab_size: int, field: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{field}: expected a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field}: token ids must be ints, got {t!r}")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"{field}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def parse_generate(body, tokenizer, vocab_size: int, max_positions: int) -> tuple[list[GenerateInput], bool]:
    """Return (inputs, is_batch). Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    ids = body.get("input_ids")
    text = body.get("text")
    if ids is None and text is None:
        raise BadRequest("input_ids: missing (give input_ids or text)")
    if ids is not None:
        is_batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = [_check_ids(x, vocab_size, f"input_ids[{i}]" if is_batch else "input_ids") for i, x in enumerate(ids if is_batch else [ids])]
    else:
        is_batch = isinstance(text, list)
        texts = text if is_batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text: expected a string or a list of strings")
        prompts = [tokenizer.encode(t) for t in texts]
        for i, p in enumerate(prompts):
            if not p:
                raise BadRequest(f"text{f'[{i}]' if is_batch else ''}: encodes to no tokens")
    rids = body.get("rid")
    if is_batch:
        if rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        if not isinstance(rids, list) or len(rids) != len(prompts) or not all(isinstance(r, str) for r in rids):
            raise BadRequest("rid: for a batch, expected a list of strings, one per prompt")
    else:
        if rids is None:
            rids = uuid.uuid4().hex
        if not isinstance(rids, str):
            raise BadRequest("rid: expected a string")
        rids = [rids]
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != len(prompts):
            raise BadRequest("sampling_params: a list must have one entry per prompt")
    else:
        sps = [sps] * len(prompts)
    stream = bool(body.get("stream", False))
    if stream and is_batch:
        raise BadRequest("stream: streaming a batch request is not supported")
    return_logprob = bool(body.get("return_logprob", False))
    out = []
    for p, rid, sp in zip(prompts, rids, sps):
        if len(p) >= max_positions:
            raise BadRequest(f"input_ids: prompt of {len(p)} tokens reaches the model's max positions ({max_positions})")
        out.append(GenerateInput(rid, p, parse_sampling_params(sp, len(p), max_positions), return_logprob, stream,
                                 bool(body.get("return_text_in_logprobs", False))))
    return out, is_batch


def build_response(req, tokenizer, return_logprob: bool, weight_version: str, finished: bool, token_text: bool = False) -> dict:
    """SGLang's /generate response (cumulative) for a scheduler Request."""
    p = req.params
    output_ids = list(req.output_ids)
    logprobs = list(req.logprobs)
    text = tokenizer.decode(output_ids, skip_special_tokens=p.skip_special_tokens)
    reason = req.finish_reason if finished else None
    if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str) and not p.no_stop_trim:
        text = text[: len(text) - len(reason["matched"])]
    meta = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(output_ids),
        "cached_tokens": getattr(req, "cached_tokens", 0),
        "weight_version": weight_version,
        "e2e_latency": None,
    }
    if return_logprob:
        texts = [tokenizer.decode([t]) for t in output_ids] if token_text else [None] * len(output_ids)
        meta["output_token_logprobs"] = [[lp, t, x] for lp, t, x in zip(logprobs, output_ids, texts)]
        meta["input_token_logprobs"] = []
    return {"text": text, "output_ids": output_ids, "meta_info": meta}
