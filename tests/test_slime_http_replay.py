"""The embedded engine behind the real sglang-router 0.3.2, driven the way upstream slime drives SGLang.

Written from THUDM/slime's rollout/sglang_rollout.py and backends/sglang_utils/: same endpoints and payloads."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import aiohttp
import pytest
import requests

from slime.backends.hf_engine.local_server import EngineServer
from slime.backends.sglang_utils.process_utils import pick_free_ports
from slime.backends.sglang_utils.router import Router
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

WORDS = [str(i) for i in range(10)] + list("abcdefghij")
SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=512)
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tok = build_tokenizer(WORDS)
    out = {}
    for seed, name in ((0, "m0"), (1, "m1")):
        d = tmp_path_factory.mktemp(name)
        build_tiny_qwen3(str(d), tok, SPEC, seed=seed)
        out[name] = d
    return out


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory, base_args):
    logs = tmp_path_factory.mktemp("replay_logs")
    engine = EngineServer(models["m0"], ["--seed", "0"], log_path=str(logs / "engine.log"))
    router = None
    try:
        engine.wait_healthy()
        port, prom = pick_free_ports(2)
        router = Router.start(base_args, port, prom, str(logs), timeout=60)
        router.add_worker(engine.url)
        router.wait_workers_healthy([engine.url], timeout=60)
        yield SimpleNamespace(engine=engine, router=router, url=router.url)
    finally:
        if router is not None:
            router.shutdown()
        assert engine.stop() == 0, (logs / "engine.log").read_text()[-3000:]


def slime_payload(input_ids, max_new_tokens, temperature=0.0):
    """The body upstream slime's `generate` posts to the router."""
    sampling_params = dict(temperature=temperature, top_p=1.0, top_k=-1, max_new_tokens=max_new_tokens, stop=None,
                           stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                           spaces_between_special_tokens=False, ignore_eos=True)
    return {"sampling_params": sampling_params, "return_logprob": True, "input_ids": list(input_ids)}


def slime_parse(output):
    """What upstream slime keeps from a reply."""
    meta = output["meta_info"]
    rows = meta.get("output_token_logprobs", [])
    return ([r[1] for r in rows], [r[0] for r in rows], output["text"], meta.get("weight_version"),
            meta["finish_reason"]["type"])


def requests_in_load(load) -> int:
    """Requests a worker still holds, read from a /v1/loads reply the way slime's drain loop reads it."""
    if isinstance(load, list):
        return sum(requests_in_load(x) for x in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return requests_in_load(load["loads"])
    total = next((load[k] for k in ("num_reqs", "num_total_reqs", "total_reqs") if isinstance(load.get(k), int)), None)
    if total is None:
        total = int(load.get("num_running_reqs") or 0) + int(load.get("num_waiting_reqs") or 0)
    queues = [v for k, v in load.items() if k.endswith("_queue_reqs") and isinstance(v, int)]
    for section in ("queues", "disaggregation"):
        if isinstance(load.get(section), dict):
            queues += [v for k, v in load[section].items()
                       if isinstance(v, int) and (k in ("waiting", "retracted") or k.endswith("_queue_reqs"))]
    return max([total, *queues])


async def abort_until_idle(session, urls, timeout=30.0, interval=0.05) -> int:
    """slime's drain: per worker, POST /abort_request {"abort_all": true} then GET /v1/loads until it holds none."""
    rounds = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for url in urls:
        while True:
            rounds += 1
            async with session.post(f"{url}/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            async with session.get(f"{url}/v1/loads?include=core,disagg,queues") as r:
                assert r.status == 200, await r.text()
                if requests_in_load(await r.json()) <= 0:
                    break
            assert loop.time() < deadline, "engine never became idle"
            await asyncio.sleep(interval)
    return rounds


def slime_weight_version(worker_url) -> str:
    """slime's SGLangEngine.get_weight_version: /model_info (newer SGLang), else /get_weight_version."""
    for path in ("/model_info", "/get_weight_version"):
        r = requests.get(worker_url + path, timeout=10)
        if r.status_code == 200:
            return r.json()["weight_version"]
    r.raise_for_status()


def test_twenty_bad_requests_in_a_row_do_not_stop_the_next_valid_one(stack):
    bad = [{"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10_000}},  # past max positions
           {"input_ids": [1, 99_999]},  # out of the vocabulary
           {"input_ids": PROMPT, "return_hidden_states": True},  # refused field
           {"input_ids": PROMPT, "sampling_params": {"repetition_penalty": 1.3}}]
    for i in range(20):
        r = requests.post(stack.url + "/generate", json=bad[i % len(bad)], timeout=30)
        assert r.status_code == 400, r.text  # the worker's 400, passed through with its message
    r = requests.post(stack.url + "/generate", json=slime_payload(PROMPT, 4), timeout=30)
    assert r.status_code == 200, r.text  # sglang-router's breaker would answer 503 no_available_workers here
    assert len(slime_parse(r.json())[0]) >= 1


@pytest.mark.parametrize("body, field", [
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10_000}}, "max_new_tokens"),
    ({"input_ids": [1, 99_999]}, "input_ids"),
    ({"input_ids": PROMPT, "return_hidden_states": True}, "return_hidden_states"),
    ({"input_ids": PROMPT, "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": PROMPT, "custom_logit_processor": "x"}, "custom_logit_processor"),
    ({"input_ids": PROMPT, "sampling_params": {"min_new_tokens": 2}}, "min_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"input_ids": PROMPT, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": PROMPT, "stream": "false"}, "stream"),  # the router's own typed check: 422
    ({"input_ids": PROMPT, "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
])
def test_bad_input_through_the_router_names_the_field_and_the_engine_keeps_serving(stack, body, field):
    r = requests.post(stack.url + "/generate", json=body, timeout=30)
    assert 400 <= r.status_code < 500 and field in r.text, r.text
    assert requests.post(stack.url + "/generate", json=slime_payload(PROMPT, 2), timeout=30).status_code == 200


def test_router_drops_some_sampling_params_before_the_worker(stack):
    """Pins the docs' list (docs/sglang-compat.md)."""
    sp = {"max_new_tokens": 3, "logit_bias": {"7": 100.0}, "ignore_eos": True}
    direct = stack.engine.post("/generate", {"input_ids": PROMPT, "sampling_params": sp}).json()
    assert direct["output_ids"] == [7, 7, 7]
    routed = requests.post(stack.url + "/generate", json={"input_ids": PROMPT, "sampling_params": {**sp, "temperature": 0}},
                           timeout=30).json()
    assert routed["output_ids"] != [7, 7, 7]  # the bias never reached the worker
    typo = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temprature": 0.1}}
    assert stack.engine.post("/generate", typo).status_code == 400
    assert requests.post(stack.url + "/generate", json=typo, timeout=30).status_code == 200  # silently dropped


def test_upstream_slime_http_calls_replayed(stack, models):
    workers = [w["url"] for w in requests.get(stack.url + "/workers", timeout=10).json()["workers"]]
    assert workers == [stack.engine.url]
    assert slime_weight_version(workers[0]) == "0"
    assert requests.get(workers[0] + "/get_weight_version", timeout=10).status_code == 404  # gone in SGLang 0.5.21
    total = 300
    reference = requests.post(stack.url + "/generate", json=slime_payload(PROMPT, total), timeout=60).json()
    ref_ids, ref_lps, _, _, _ = slime_parse(reference)

    async def rollout_then_abort():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one(i):
                async with session.post(stack.url + "/generate", json=slime_payload(PROMPT, total)) as r:
                    assert r.status == 200
                    return await r.json()

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            deadline = asyncio.get_running_loop().time() + 30
            while True:  # until every request is decoding
                async with session.get(workers[0] + "/v1/loads?include=core") as r:
                    load = (await r.json())["loads"][0]
                if load["num_running_reqs"] == 4 and load["num_used_tokens"] > 4 * (len(PROMPT) + 3):
                    break
                assert asyncio.get_running_loop().time() < deadline and not any(t.done() for t in tasks), load
                await asyncio.sleep(0.02)
            rounds = await abort_until_idle(session, workers)
            return rounds, await asyncio.wait_for(asyncio.gather(*tasks), 60)

    rounds, outs = asyncio.run(rollout_then_abort())
    assert rounds >= 1
    for out in outs:
        ids, lps, _, version, finish = slime_parse(out)
        assert finish == "abort" and 0 < len(ids) < total and version == "0"
        assert ids == ref_ids[: len(ids)] and lps == pytest.approx(ref_lps[: len(ids)], abs=1e-4)
        # resume by tokens (max_new_tokens reduced by the tokens already generated), as slime's partial rollout does
        rest = requests.post(stack.url + "/generate", json=slime_payload(PROMPT + ids, total - len(ids)), timeout=60).json()
        rest_ids, rest_lps, _, _, rest_finish = slime_parse(rest)
        assert rest_finish in ("length", "stop") and ids + rest_ids == ref_ids[: len(ids) + len(rest_ids)]
        assert rest_lps == pytest.approx(ref_lps[len(ids): len(ids) + len(rest_ids)], abs=1e-4)

    # slime's disk weight update, sent to every worker (the router does not route it)
    reply = requests.post(workers[0] + "/update_weights_from_disk",
                          json={"model_path": str(models["m1"]), "weight_version": "1", "abort_all_requests": False},
                          timeout=120).json()
    assert reply["success"] and reply["num_paused_requests"] == 0, reply
    assert slime_weight_version(workers[0]) == "1"
    after = requests.post(stack.url + "/generate", json=slime_payload(PROMPT, 4), timeout=60).json()
    assert slime_parse(after)[3] == "1" and after["meta_info"]["weight_versions"][-1]["version"] == "1"
    # the reply can reach us before the engine's next step takes the finished request out of its batch (as in
    # SGLang, where the scheduler filters finished requests at its next iteration): wait for the load to say idle
    deadline = time.monotonic() + 30
    while True:
        loads = requests.get(workers[0] + "/v1/loads?include=core,disagg,queues", timeout=10).json()
        assert len(loads["loads"]) == 1 and "queues" in loads["loads"][0]
        if requests_in_load(loads) == 0:
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.02)
    assert requests.get(workers[0] + "/v1/loads?include=nope", timeout=10).status_code == 400
    assert json.loads(requests.get(workers[0] + "/v1/loads?dp_rank=3", timeout=10).text)["loads"] == []
