"""Every field of SGLang's `GenerateReqInput` and `SamplingParams`, and what the embedded engine does with it:
honoured, accepted (cannot change the output here), or refused with a 400 unless neutral; unknown fields are refused
(tests/test_hf_engine_schema.py checks the tables against SGLang's). Also the strict JSON readers (a boolean must be
a JSON boolean, an integer a JSON integer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any


class BadRequest(ValueError):
    """Client error; the message names the offending field."""


@dataclass(frozen=True)
class Refused:
    """Accepted only at one of `neutral` (SGLang's default and its equivalents), else a 400 saying `why`."""

    why: str
    neutral: tuple = (None, False)


@dataclass(frozen=True)
class NoEffect:
    """Accepted (type-checked): its purpose is already met by an engine with one DP rank and no metrics."""

    why: str
    kinds: tuple = (str,)


HONOURED = "honoured"
_MM = "multimodal inputs: the embedded engine serves text-only causal LMs"
_DISAGG = "prefill/decode disaggregation is not supported by the embedded engine"

# Top-level /generate fields.
GENERATE_FIELDS: dict[str, object] = {
    "rid": HONOURED, "text": HONOURED, "input_ids": HONOURED, "sampling_params": HONOURED,
    "return_logprob": HONOURED, "logprob_start_len": HONOURED, "top_logprobs_num": HONOURED,
    "token_ids_logprob": HONOURED, "return_text_in_logprobs": HONOURED, "stream": HONOURED,
    "routed_dp_rank": HONOURED, "data_parallel_rank": HONOURED,  # the one DP rank, 0
    "extra_key": HONOURED,  # the prefix cache's namespace (prefix_cache.py)
    "log_metrics": NoEffect("the engine keeps no per-request metrics", (bool,)),
    "no_logs": NoEffect("the engine never logs request contents", (bool,)),
    "session_id": NoEffect("a routing identity; it does not change the prompt"),
    "conversation_id": NoEffect("a tracking identity"),
    "routing_key": NoEffect("used by routers, not by a worker"),
    "custom_labels": NoEffect("labels for metrics the engine does not keep", (dict,)),
    "external_trace_header": NoEffect("tracing is not enabled", (dict,)),
    "received_time": NoEffect("a timing annotation", (int, float)),
    "input_embeds": Refused("give input_ids or text; embeddings as input are not supported"),
    "image_data": Refused(_MM, (None, [])), "video_data": Refused(_MM, (None, [])),
    "audio_data": Refused(_MM, (None, [])), "mm_hashes": Refused(_MM, (None, [])),
    "mm_content_hashes": Refused(_MM, (None, [])), "use_audio_in_video": Refused(_MM),
    "video_config": Refused(_MM), "modalities": Refused(_MM, (None, [])),
    "max_dynamic_patch": Refused(_MM), "min_dynamic_patch": Refused(_MM),
    "image_max_dynamic_patch": Refused(_MM), "video_max_dynamic_patch": Refused(_MM),
    "images_config": Refused(_MM), "need_wait_for_mm_inputs": Refused(_MM),
    "num_items_assigned": Refused(_MM), "encoder_urls": Refused(_MM, (None, [])),
    "positional_embed_overrides": Refused("embedding overrides are not supported"),
    "return_sampling_mask": Refused("sampling masks are not returned"),
    "return_flat_raw_top_logprobs": Refused("top log-probs come as SGLang's nested lists only"),
    "return_flat_raw_top_logprobs_b64": Refused("top log-probs come as SGLang's nested lists only"),
    "return_hidden_states": Refused("hidden states are not returned"),
    "return_routed_experts": Refused("the embedded engine runs no mixture-of-experts routing"),
    "routed_experts_start_len": Refused("the embedded engine runs no mixture-of-experts routing", (None, 0)),
    "return_indexer_topk": Refused("no sparse-attention indexer"),
    "session_params": Refused("sessions are not supported; send the full input_ids", (None, {})),
    "lora_path": Refused("LoRA adapters are not supported"),
    "lora_id": Refused("LoRA adapters are not supported"),
    "custom_logit_processor": Refused("custom logit processors are not enabled (SGLang: --enable-custom-logit-processor)"),
    "bootstrap_host": Refused(_DISAGG), "bootstrap_port": Refused(_DISAGG), "bootstrap_room": Refused(_DISAGG),
    "bootstrap_pair_key": Refused(_DISAGG), "decode_tp_size": Refused(_DISAGG),
    "disagg_prefill_dp_rank": Refused(_DISAGG), "kv_router_hint": Refused(_DISAGG),
    "http_worker_ipc": Refused("an SGLang-internal field"),
    "background": Refused("background responses belong to the OpenAI responses API"),
    "require_reasoning": Refused("no reasoning parser"), "max_thinking_tokens": Refused("no reasoning parser"),
    "priority": Refused("priority scheduling is not supported (SGLang: --enable-priority-scheduling)"),
    "cache_salt": Refused("prefix-cache namespaces are not supported", (None, "")),
    "return_bytes": Refused("image generation only"),
    "return_entropy": Refused("entropies are not returned"),
    "return_prompt_token_ids": Refused("prompt token ids are not returned"),
    "multi_item_delimiter_indices": Refused("multi-item scoring is not supported"),
    # not a GenerateReqInput field: sglang-router 0.3.2 adds `"model": null` to every body it forwards
    "model": Refused("model selection is the router's; a worker serves one model", (None,)),
}

# sampling_params fields.
SAMPLING_FIELDS: dict[str, object] = {
    **{k: HONOURED for k in (
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval",
        "logit_bias", "sampling_seed", "n")},
    "frequency_penalty": Refused("penalties are not implemented", (None, 0, 0.0)),
    "presence_penalty": Refused("penalties are not implemented", (None, 0, 0.0)),
    "repetition_penalty": Refused("penalties are not implemented", (None, 1, 1.0)),
    "min_new_tokens": Refused("min_new_tokens is not implemented", (None, 0)),
    "json_schema": Refused("constrained decoding is not implemented", (None,)),
    "regex": Refused("constrained decoding is not implemented", (None,)),
    "ebnf": Refused("constrained decoding is not implemented", (None,)),
    "structural_tag": Refused("constrained decoding is not implemented", (None,)),
    "custom_params": Refused("custom_params only feed a custom logit processor, which is not enabled", (None, {})),
}


def _same(a, b) -> bool:
    return a == b and type(a) is type(b) if isinstance(a, bool) or isinstance(b, bool) else a == b


def check_fields(body: dict, table: dict[str, object], where: str, what: str) -> None:
    """Refuse unknown fields and non-neutral refused ones; type-check no-effect ones (400 naming the field)."""
    for name, value in body.items():
        rule = table.get(name)
        if rule is None:
            raise BadRequest(f"{where}{name}: unknown field (not a field of SGLang's {what})")
        if isinstance(rule, Refused) and not any(_same(value, n) for n in rule.neutral):
            raise BadRequest(f"{where}{name}: not supported by the embedded engine ({rule.why}); "
                             f"only {' or '.join(json.dumps(n) for n in rule.neutral)} is accepted, got {json.dumps(value)}")
        if isinstance(rule, NoEffect) and value is not None and (
                not isinstance(value, rule.kinds) or (bool not in rule.kinds and isinstance(value, bool))):
            raise BadRequest(f"{where}{name}: expected {'/'.join(k.__name__ for k in rule.kinds)}, got {value!r}")


# ---- strict readers: None (or absent) means the default ------------------------------------------------
def read_bool(d: dict, name: str, default: bool, where: str = "") -> bool:
    v = d.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{where}{name}: expected a JSON boolean (true/false), got {v!r}")
    return v


def read_int(d: dict, name: str, default, where: str = "", lo: int | None = None):
    v = d.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise BadRequest(f"{where}{name}: expected an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo:
        raise BadRequest(f"{where}{name}: must be >= {lo}, got {v}")
    return v


def read_float(d: dict, name: str, default: float, where: str = "") -> float:
    v = d.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"{where}{name}: expected a finite number, got {v!r}")
    return float(v)


def read_str_list(d: dict, name: str, where: str = "") -> list[str]:
    """A string or a list of strings (SGLang's `stop`, `stop_regex`)."""
    v = d.get(name)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequest(f"{where}{name}: expected a string or a list of strings, got {v!r}")
    return [s for s in v if s]


def read_int_list(v: Any, field: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise BadRequest(f"{field}: expected a list of integers, got {v!r}")
    return v
