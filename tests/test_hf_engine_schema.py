"""SGLang's request schema against the embedded engine."""

from __future__ import annotations

import pytest

from slime.backends.hf_engine.fields import GENERATE_FIELDS, HONOURED, SAMPLING_FIELDS, NoEffect, Refused

from hf_engine_field_checks import HONOURED_CHECKS, PROMPT, gen, post, refused
from hf_engine_reference import load_model, tiny_model

SGLANG_GENERATE_REQ_INPUT = (
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs",
    "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states",
    "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params",
    "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank",
    "disagg_prefill_dp_rank", "kv_router_hint", "routing_key", "conversation_id", "http_worker_ipc", "background",
    "require_reasoning", "max_thinking_tokens", "priority", "extra_key", "no_logs", "custom_labels", "return_bytes",
    "return_entropy", "return_prompt_token_ids", "external_trace_header", "received_time", "need_wait_for_mm_inputs",
    "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
    "video_max_dynamic_patch", "images_config", "multi_item_delimiter_indices", "cache_salt",
)
SGLANG_SAMPLING_PARAMS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf",
    "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
)

# multi-character words, so that stop strings can end inside a token
WORDS = [str(i) for i in range(10)] + ["ab", "cde", "fgh", "ij", "klmn", "op", "qrs", "tu", "vwx", "yz"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "schema_model", seed=3, words=WORDS)[0]


@pytest.fixture(scope="module")
def ref(model_dir):
    from transformers import AutoTokenizer

    return load_model(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def server(model_dir, start_engine):
    return start_engine(model_dir, "--seed", "0")


def test_rule_table_covers_exactly_sglangs_fields():
    assert set(GENERATE_FIELDS) == set(SGLANG_GENERATE_REQ_INPUT) | {"model"}
    assert set(SAMPLING_FIELDS) == set(SGLANG_SAMPLING_PARAMS)
    honoured = {k for k, v in GENERATE_FIELDS.items() if v == HONOURED}
    honoured |= {f"sampling_params.{k}" for k, v in SAMPLING_FIELDS.items() if v == HONOURED}
    assert honoured == set(HONOURED_CHECKS)


@pytest.mark.parametrize("name", sorted(HONOURED_CHECKS))
def test_honoured_field_behaves(server, ref, name):
    HONOURED_CHECKS[name](server, ref)


def _non_neutral(rule: Refused):
    for candidate in (True, 3, "x", ["x"], {"x": 1}):
        if all(candidate != n or type(candidate) is not type(n) for n in rule.neutral):
            return candidate


REFUSED = [(k, v) for k, v in GENERATE_FIELDS.items() if isinstance(v, Refused)]
REFUSED_SP = [(k, v) for k, v in SAMPLING_FIELDS.items() if isinstance(v, Refused)]


@pytest.mark.parametrize("where, name, rule", [("", k, v) for k, v in REFUSED] + [("sampling_params", k, v) for k, v in REFUSED_SP],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_refused_field_is_400_naming_it_and_neutral_is_accepted(server, where, name, rule):
    def body(value):
        if where:
            return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1, name: value}}
        return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, name: value}

    refused(server, body(_non_neutral(rule)), name)
    for neutral in rule.neutral:
        assert post(server, body(neutral)).status_code == 200, (name, neutral)


@pytest.mark.parametrize("name", [k for k, v in GENERATE_FIELDS.items() if isinstance(v, NoEffect)])
def test_no_effect_field_is_type_checked_and_changes_nothing(server, name):
    rule = GENERATE_FIELDS[name]
    value = {bool: False, str: "abc", dict: {"k": "v"}, int: 3, float: 1.5}[rule.kinds[0]]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert gen(server, sampling_params=sp, **{name: value})["output_ids"] == gen(server, sampling_params=sp)["output_ids"]
    refused(server, {"input_ids": PROMPT, name: [1, 2]}, name)


@pytest.mark.parametrize("body, name", [
    ({"input_ids": PROMPT, "bogus_field": 1}, "bogus_field"),
    ({"input_ids": PROMPT, "sampling_params": {"temprature": 0.3}}, "temprature"),  # SGLang: unexpected keyword
    ({"input_ids": PROMPT, "stream": "false"}, "stream"),
    ({"input_ids": PROMPT, "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": PROMPT, "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
    ({"input_ids": PROMPT, "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
    ({"input_ids": PROMPT, "sampling_params": {"no_stop_trim": 0}}, "no_stop_trim"),
    ({"input_ids": PROMPT, "sampling_params": {"skip_special_tokens": "false"}}, "skip_special_tokens"),
    ({"input_ids": PROMPT, "input_embeds": [[0.1, 0.2]]}, "input_embeds"),
    ({"input_embeds": [[0.1, 0.2]]}, "input_embeds"),
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [99999]}, "token_ids_logprob"),
    ({"input_ids": PROMPT, "top_logprobs_num": 2}, "top_logprobs_num"),
    ("{not json", "body"),
    ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
    ({"input_ids": "12"}, "input_ids"),
    ({"input_ids": [1, 100000]}, "input_ids"),
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300}}, "max_new_tokens"),  # past the positions
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 1.3}}, "repetition_penalty"),
])
def test_bad_field_is_400_naming_it(server, body, name):
    refused(server, body, name)
    assert gen(server, sampling_params={"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
