"""Validation of SGLang /generate bodies and building of SGLang-shaped responses.

Every field is honoured or refused with a 400 naming it (see `fields.py` for the table); nothing is
silently ignored.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from slime.backends.hf_engine.fields import (
    GENERATE_FIELDS, SAMPLING_FIELDS, BadRequest, check_fields, read_bool, read_float, read_int, read_int_list,
    read_str_list,
)
from slime.backends.hf_engine.logprobs import LogprobRecord, LogprobSpec, finite
from slime.backends.hf_engine.sampling import SamplingParams

__all__ = ["BadRequest", "GenerateInput", "parse_generate", "parse_sampling_params", "build_response"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


@dataclass
class GenerateInput:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    stream: bool
    token_text: bool = False
    logprobs: LogprobSpec = field(default_factory=LogprobSpec)
    extra_key: str | None = None  # SGLang's prefix-cache namespace ("" is none)


def parse_sampling_params(sp, prompt_len: int, max_positions: int, vocab_size: int) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params: expected an object, got {sp!r}")
    w = "sampling_params."
    check_fields(sp, SAMPLING_FIELDS, w, "SamplingParams")
    if read_int(sp, "n", 1, w) != 1:
        raise BadRequest(f"sampling_params.n: only n=1 is supported, got {sp['n']!r} (send one request per sample)")
    room = max_positions - prompt_len
    max_new = read_int(sp, "max_new_tokens", None, w, lo=0)
    if max_new is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
    elif max_new > room:
        raise BadRequest(f"sampling_params.max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) "
                         f"exceeds the model's max positions ({max_positions})")
    stop_ids = sp.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else read_int_list(stop_ids, f"{w}stop_token_ids")
    temperature = read_float(sp, "temperature", 1.0, w)
    if temperature < 0:
        raise BadRequest(f"sampling_params.temperature: must be >= 0, got {temperature}")
    top_p = read_float(sp, "top_p", 1.0, w)
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"sampling_params.top_p: must be in (0, 1], got {top_p}")
    min_p = read_float(sp, "min_p", 0.0, w)
    if not 0.0 <= min_p <= 1.0:
        raise BadRequest(f"sampling_params.min_p: must be in [0, 1], got {min_p}")
    top_k = read_int(sp, "top_k", -1, w)
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"sampling_params.top_k: must be -1 (off) or >= 1, got {top_k}")
    interval = read_int(sp, "stream_interval", None, w, lo=1)
    return SamplingParams(
        max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        stop_token_ids=list(stop_ids), stop=read_str_list(sp, "stop", w), stop_regex=_regexes(sp),
        ignore_eos=read_bool(sp, "ignore_eos", False, w),
        skip_special_tokens=read_bool(sp, "skip_special_tokens", True, w),
        spaces_between_special_tokens=read_bool(sp, "spaces_between_special_tokens", True, w),
        no_stop_trim=read_bool(sp, "no_stop_trim", False, w),
        sampling_seed=read_int(sp, "sampling_seed", None, w),
        logit_bias=_logit_bias(sp.get("logit_bias"), vocab_size),
        stream_interval=interval,
    )


def _regexes(sp: dict) -> list[re.Pattern]:
    out = []
    for pattern in read_str_list(sp, "stop_regex", "sampling_params."):
        try:
            out.append(re.compile(pattern))
        except re.error as e:
            raise BadRequest(f"sampling_params.stop_regex: invalid regular expression {pattern!r} ({e})") from None
    return out


def _logit_bias(bias, vocab_size: int) -> dict[int, float]:
    """SGLang's logit_bias: {"<token id>": bias}; ids in the vocabulary, finite biases."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise BadRequest(f"sampling_params.logit_bias: expected an object {{\"<token id>\": bias}}, got {bias!r}")
    out = {}
    for key in bias:
        try:
            tok = int(key)
        except ValueError:
            raise BadRequest(f"sampling_params.logit_bias: key {key!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise BadRequest(f"sampling_params.logit_bias: token id {tok} is outside the vocabulary [0, {vocab_size})")
        out[tok] = read_float(bias, key, 0.0, "sampling_params.logit_bias.")
    return out


def _check_ids(ids, vocab_size: int, field: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"{field}: expected a non-empty list of token ids")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"{field}: token ids must be ints, got {t!r}")
        if not 0 <= t < vocab_size:
            raise BadRequest(f"{field}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return ids


def _per_item(body: dict, name: str, n: int, is_batch: bool, nested: bool = False) -> list:
    """A field given once for the whole batch or (in a batch) as a list with one entry per prompt."""
    v = body.get(name)
    per = isinstance(v, list) and is_batch and (not nested or (bool(v) and isinstance(v[0], list)))
    if not per:
        return [v] * n
    if len(v) != n:
        raise BadRequest(f"{name}: a list must have one entry per prompt ({n}), got {len(v)}")
    return v


def _logprob_spec(item: dict, name_suffix: str, prompt_len: int, return_logprob: bool, vocab_size: int) -> LogprobSpec:
    start = read_int(item, "logprob_start_len", -1, lo=-1)
    top_k = read_int(item, "top_logprobs_num", 0, lo=0)
    ids = item.get("token_ids_logprob")
    ids = tuple(_check_ids(ids, vocab_size, "token_ids_logprob")) if ids else ()
    spec = LogprobSpec(start, top_k, ids)
    if spec.any and not return_logprob:
        asked = [n for n, on in (("logprob_start_len", start >= 0), ("top_logprobs_num", top_k), ("token_ids_logprob", ids)) if on]
        raise BadRequest(f"{asked[0]}{name_suffix}: needs return_logprob: true (log-probs are only returned then)")
    if start >= prompt_len:
        raise BadRequest(f"logprob_start_len{name_suffix}: {start} is not a position of the {prompt_len}-token prompt")
    return spec


def parse_generate(body, tokenizer, vocab_size: int, max_positions: int) -> tuple[list[GenerateInput], bool]:
    """Return (inputs, is_batch). Raises BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    check_fields(body, GENERATE_FIELDS, "", "GenerateReqInput")
    for name in ("routed_dp_rank", "data_parallel_rank"):
        if read_int(body, name, 0) != 0:
            raise BadRequest(f"{name}: the embedded engine has one data-parallel rank (0), got {body[name]!r}")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is None and text is None:
        raise BadRequest("input_ids: missing (give input_ids or text)")
    if ids is not None and text is not None:
        raise BadRequest("text: give either input_ids or text, not both")
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
    n = len(prompts)
    rids = body.get("rid")
    if is_batch:
        if rids is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        if not isinstance(rids, list) or len(rids) != n or not all(isinstance(r, str) for r in rids):
            raise BadRequest("rid: for a batch, expected a list of strings, one per prompt")
        if len(set(rids)) != n:
            raise BadRequest(f"rid: duplicate request ids in the batch: {sorted({r for r in rids if rids.count(r) > 1})}")
    else:
        if rids is None:
            rids = uuid.uuid4().hex
        if not isinstance(rids, str):
            raise BadRequest("rid: expected a string")
        rids = [rids]
    stream = read_bool(body, "stream", False)
    if stream and is_batch:
        raise BadRequest("stream: streaming a batch request is not supported")
    token_text = read_bool(body, "return_text_in_logprobs", False)
    columns = {name: _per_item(body, name, n, is_batch, nested=name == "token_ids_logprob")
               for name in ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                            "extra_key")}
    out = []
    for i, (p, rid) in enumerate(zip(prompts, rids)):
        item = {name: col[i] for name, col in columns.items()}
        suffix = f"[{i}]" if is_batch else ""
        if len(p) >= max_positions:
            raise BadRequest(f"input_ids{suffix}: prompt of {len(p)} tokens reaches the model's max positions ({max_positions})")
        return_logprob = read_bool(item, "return_logprob", False)
        spec = _logprob_spec(item, suffix, len(p), return_logprob, vocab_size)
        params = parse_sampling_params(item["sampling_params"], len(p), max_positions, vocab_size)
        key = item["extra_key"]
        if key is not None and not isinstance(key, str):
            raise BadRequest(f"extra_key{suffix}: expected a string, got {key!r}")
        out.append(GenerateInput(rid, p, params, return_logprob, stream, token_text, spec, key or None))
    return out, is_batch


# ---- responses ------------------------------------------------------------------------------------------
def response_text(req, tokenizer) -> str:
    """The output text as SGLang's detokenizer returns it: a matched stop token is cut unless no_stop_trim,
    and a matched stop string (or stop regex match) ends the text, itself cut unless no_stop_trim."""
    p = req.params
    ids = list(req.output_ids)
    reason = req.finish_reason or {}
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    if isinstance(matched, int) and not isinstance(matched, bool) and not p.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                            spaces_between_special_tokens=p.spaces_between_special_tokens)
    if isinstance(matched, str):
        regex = next((r for r in p.stop_regex if r.pattern == matched), None) if matched not in p.stop else None
        m = regex.search(text) if regex is not None else None
        start, end = (m.start(), m.end()) if m else (text.find(matched), text.find(matched) + len(matched))
        if start >= 0:
            text = text[:end] if p.no_stop_trim else text[:start]
    return text


def _entries(pairs, tokenizer, token_text: bool) -> list:
    """[[logprob, token id, text or None], ...] from (logprob, token id) pairs."""
    return [[lp if lp is None else finite(lp), t, tokenizer.decode([t]) if token_text else None] for lp, t in pairs]


def version_spans(req, current_version: str) -> list[dict]:
    """`meta_info.weight_versions`: [{"version", "start", "end"}] covering output_ids[start:end] (the spans
    newer SGLang returns). A request with no output yet has one empty span at the current version."""
    n = len(req.output_ids)
    starts = list(req.version_spans) or [(0, current_version)]
    return [{"version": v, "start": s, "end": starts[k + 1][0] if k + 1 < len(starts) else n}
            for k, (s, v) in enumerate(starts)]


def build_response(req, tokenizer, return_logprob: bool, weight_version: str, finished: bool, token_text: bool = False) -> dict:
    """SGLang's /generate response (cumulative) for a scheduler Request snapshot."""
    output_ids = list(req.output_ids)
    reason = req.finish_reason if finished else None
    # SGLang 0.5.23's keys (tokenizer_manager.py), as its own server answers on CPU (tests/test_real_sglang.py
    # compares them): no reasoning parser here, every cached token on the device, one DP rank (null)
    meta = {
        "id": req.rid,
        "finish_reason": reason,
        "prompt_tokens": len(req.input_ids),
        "weight_version": weight_version,
        "num_retractions": req.retractions,
        "reasoning_tokens": 0,
        "completion_tokens": len(output_ids),
        "cached_tokens": req.cached_tokens,
        "cached_tokens_details": {"device": req.cached_tokens, "host": 0} if req.cached_tokens else None,
        "dp_rank": None,
    }
    if finished:  # SGLang adds these once the request finished (or aborted): the per-token version spans too
        meta["weight_versions"] = spans = version_spans(req, weight_version)
        meta["weight_version"] = spans[-1]["version"]
        meta["e2e_latency"] = time.monotonic() - req.created
        meta["response_sent_to_client_ts"] = time.time()
    if return_logprob:
        meta["output_token_logprobs"] = _entries(zip(req.logprobs, output_ids), tokenizer, token_text)
        meta["output_token_logprobs_length"] = len(output_ids)
        rec: LogprobRecord | None = req.logprobs_extra
        meta["input_token_logprobs"] = [] if rec is None or rec.prompt is None else \
            _entries(zip(rec.prompt, rec.prompt_ids), tokenizer, token_text)
        if rec is not None and rec.spec.top_k:
            meta["output_top_logprobs"] = [_entries(top, tokenizer, token_text) for top in rec.output_top]
            if rec.spec.wants_prompt:
                meta["input_top_logprobs"] = [None if top is None else _entries(top, tokenizer, token_text)
                                              for top in rec.prompt_top or []]
        if rec is not None and rec.spec.token_ids:
            ids = rec.spec.token_ids
            meta["output_token_ids_logprobs"] = [_entries(zip(row, ids), tokenizer, token_text) for row in rec.output_token_ids]
            if rec.spec.wants_prompt:
                meta["input_token_ids_logprobs"] = [None if row is None else _entries(zip(row, ids), tokenizer, token_text)
                                                    for row in rec.prompt_token_ids or []]
    return {"text": response_text(req, tokenizer), "output_ids": output_ids, "meta_info": meta}
