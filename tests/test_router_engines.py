"""EngineGroup end to end: two embedded engines behind the real sglang-router 0.3.2, every fan-out reaching both."""

from __future__ import annotations

import asyncio
import datetime
import os
import time

import aiohttp
import pytest
import requests
import torch

from slime.arguments import parse_args
from slime.backends.sglang_utils import http_client
from slime.backends.sglang_utils.engine_group import EngineGroup, EngineGroupError
from slime.backends.sglang_utils.process_utils import ServerLaunchError, pick_free_ports, process_group_members
from slime.utils.tiny_model import build_tiny_qwen3, build_tokenizer

pytestmark = pytest.mark.slow

WORDS = list("0123456789=,")


def _args(model_dir, tmp, *extra):
    prompts = os.path.join(tmp, "prompts.jsonl")
    open(prompts, "a").close()
    return parse_args(["--hf-checkpoint", str(model_dir), "--prompt-data", prompts, "--rm-type", "math",
                       "--num-rollout", "1", "--rollout-batch-size", "2", "--rollout-backend", "embedded",
                       "--run-dir", os.path.join(tmp, "run"), *extra])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = build_tokenizer(WORDS)
    build_tiny_qwen3(str(root / "m0"), tok, seed=0)
    new = build_tiny_qwen3(str(root / "m1"), tok, seed=1)  # the "trained" weights
    return {"root": root, "m0": root / "m0", "m1": root / "m1", "m1_state": new.state_dict()}


@pytest.fixture(scope="module")
def group(models):
    g = EngineGroup(_args(models["m0"], str(models["root"]), "--rollout-num-gpus", "2"),
                    log_dir=str(models["root"] / "logs"))
    g.start()
    models["m0_greedy"] = _gen(g.engine_urls[0], "m0-reference")  # before any weight update
    yield g
    g.shutdown()


def _gen(url, rid, max_new=6, temperature=0.0, **extra):
    payload = {"input_ids": [1, 4, 5, 10, 7], "rid": rid, "return_logprob": True,
               "sampling_params": {"max_new_tokens": max_new, "temperature": temperature, **extra}}
    return http_client.post_json(url + "/generate", payload, timeout=60)


def test_workers_listed_healthy(group):
    listed = requests.get(group.router_url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(group.engine_urls)
    assert all(w["is_healthy"] for w in listed) and len(listed) == 2
    assert group.worker_urls() == sorted(group.engine_urls)


def test_generate_through_router_has_documented_shape(group):
    out = _gen(group.router_url, "shape-1", max_new=6, temperature=1.0)
    meta = out["meta_info"]
    assert isinstance(out["text"], str) and meta["id"] == "shape-1"
    ids = out["output_ids"]
    assert 1 <= len(ids) <= 6 and all(isinstance(t, int) for t in ids)
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(ids)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 6 and len(ids) == 6
    assert meta["weight_version"] == "0"
    lps = meta["output_token_logprobs"]
    assert [row[1] for row in lps] == ids
    assert all(isinstance(row[0], float) and row[0] <= 0.0 for row in lps)


def test_router_does_not_route_control_endpoints(group):
    # sglang-router 0.3.2: these are 404 at the router, so EngineGroup sends them to each worker.
    worker = group.engine_urls[0]
    for path, body in [("/abort_request", {"rid": "nobody"}), ("/pause_generation", {"mode": "abort"}),
                       ("/continue_generation", {}), ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
                       ("/init_weights_update_group", {}), ("/list_workers", {}), ("/add_worker", {})]:
        assert requests.post(group.router_url + path, json=body, timeout=10).status_code == 404, path
    assert requests.post(worker + "/abort_request", json={"rid": "nobody"}, timeout=10).status_code == 200
    requests.post(worker + "/continue_generation", json={}, timeout=10).raise_for_status()


def test_router_rejects_batch_rid_list(group):
    resp = requests.post(group.router_url + "/generate", json={"input_ids": [[1, 4], [1, 5]], "rid": ["a", "b"],
                                                              "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert 400 <= resp.status_code < 500


def test_flush_cache_is_fanned_out_by_router(group):
    out = group.flush_cache()
    assert out["workers_flushed"] == 2 and out["total_http_workers"] == 2


def test_pause_and_continue_reach_every_worker(group):
    def paused():
        return [http_client.get_json(u + "/get_server_info", 10)["internal_states"][0]["paused"] for u in group.engine_urls]

    # as SGLang 0.5.23: abort pauses only the HTTP side and aborts; retract / in_place also pause the scheduler
    asyncio.run(group.pause("retract"))
    try:
        assert paused() == [True, True]
    finally:
        asyncio.run(group.continue_generation())
    assert paused() == [False, False]
    with pytest.raises(ValueError, match="mode"):
        asyncio.run(group.pause("freeze"))


def test_abort_all_until_idle_stops_in_flight_requests_on_both_engines(group):
    n = 8

    async def main():
        async with aiohttp.ClientSession() as s:
            payload = lambda i: {"input_ids": [1, 4, 5], "rid": f"long-{i}", "return_logprob": True,  # noqa: E731
                                 "sampling_params": {"max_new_tokens": 900, "temperature": 1.0, "ignore_eos": True}}
            tasks = [asyncio.create_task(http_client.generate(s, group.router_url, payload(i), timeout=120)) for i in range(n)]
            deadline = time.monotonic() + 60  # until both engines are decoding
            while True:
                loads = await asyncio.to_thread(group.load)
                if all(ld["loads"][0]["num_running_reqs"] > 0 for ld in loads.values()):
                    break
                assert time.monotonic() < deadline, f"engines never both busy: {loads}"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # let a few tokens be generated
            # returns once every worker reports no request; raises naming the busy ones if that never happens
            await group.abort_all_until_idle(timeout=30)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)

    results = asyncio.run(main())
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    assert all(len(r["output_ids"]) < 900 for r in results)
    assert sum(len(r["output_ids"]) for r in results) > 0  # partial outputs came back
    assert all(len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"]) for r in results)
    from slime.backends.sglang_utils.engine_api import busy_requests

    assert all(busy_requests(ld) == 0 for ld in group.load().values())  # read from /v1/loads


def test_update_weights_from_disk_bumps_every_worker(group, models):
    before = [_gen(u, f"pre-{i}") for i, u in enumerate(group.engine_urls)]
    res = group.weights.from_disk(str(models["m1"]), version=3)
    assert set(res) == set(group.engine_urls) and all(r["success"] for r in res.values())
    after = [_gen(u, f"post-{i}") for i, u in enumerate(group.engine_urls)]
    assert [a["meta_info"]["weight_version"] for a in after] == ["3", "3"]
    assert after[0]["meta_info"]["output_token_logprobs"] == after[1]["meta_info"]["output_token_logprobs"]
    assert before[0]["meta_info"]["output_token_logprobs"] != after[0]["meta_info"]["output_token_logprobs"]

    with pytest.raises(EngineGroupError) as e:
        group.weights.from_disk(str(models["root"] / "missing"), version=4)
    assert all(u in str(e.value) for u in group.engine_urls)
    assert [_gen(u, f"still-{i}")["meta_info"]["weight_version"] for i, u in enumerate(group.engine_urls)] == ["3", "3"]


def test_distributed_weight_update_over_gloo(group, models):
    """Trainer = rank 0 of a gloo group with both engines; broadcast m0's weights back, version 5."""
    from transformers import AutoModelForCausalLM

    from slime.utils import weight_update_group

    state = AutoModelForCausalLM.from_pretrained(str(models["m0"]), dtype=torch.float32).state_dict()
    port = pick_free_ports(1)[0]
    world = group.weights.world_size()
    assert world == 3
    futs = group.weights.init_group("127.0.0.1", port)  # engines block until the trainer joins
    timeout = datetime.timedelta(seconds=20)
    store = torch.distributed.TCPStore("127.0.0.1", port, world, is_master=True, timeout=timeout)
    pg = weight_update_group.join("gloo", store, 0, world, "weight_update_group", timeout)  # SGLang's layout
    try:
        group.weights.wait(futs, "init_weights_update_group", timeout=60, check_success=True)
        names = list(state)
        sessions = group.weights.begin()
        # both spellings SGLang takes for a dtype: "torch.float32" and "float32"
        dtypes = [str(state[n].dtype).replace("torch.", "", i % 2) for i, n in enumerate(names)]
        futs = group.weights.from_distributed(names, dtypes,
                                                     [list(state[n].shape) for n in names], weight_version=5)
        for n in names:
            pg.broadcast(state[n].contiguous(), 0).wait()
        group.weights.wait(futs, "update_weights_from_distributed", timeout=60, check_success=True)
        sessions.close()
        group.weights.wait(group.weights.destroy_group(), "destroy_weights_update_group", timeout=30,
                       check_success=True)
    finally:
        weight_update_group.leave(pg)
        del store
    outs = [_gen(u, f"dist-{i}") for i, u in enumerate(group.engine_urls)]
    assert [o["meta_info"]["weight_version"] for o in outs] == ["5", "5"]
    # back on m0's weights: the same greedy output a fresh m0 engine gave before any update
    ref = models["m0_greedy"]
    for o in outs:
        assert o["output_ids"] == ref["output_ids"]
        got = [row[0] for row in o["meta_info"]["output_token_logprobs"]]
        want = [row[0] for row in ref["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-5)


def test_engine_with_bad_model_path_fails_naming_it_and_cleans_up(models, tmp_path):
    bad = tmp_path / "not_a_model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no_such_architecture"}')  # passes the host's path check
    g = EngineGroup(_args(bad, str(tmp_path)), log_dir=str(tmp_path / "logs"), startup_timeout=120)
    with pytest.raises(ServerLaunchError) as e:
        g.start()
    msg = str(e.value)
    assert "engine 0 (embedded)" in msg and "exited with code" in msg and str(bad) in msg
    last_line = [ln for ln in open(g.engines[0].log_path).read().splitlines() if ln.strip()][-1]
    assert last_line.strip() in msg  # the engine's own log tail
    assert not g.router.process.is_alive()
    for pid in [eng.pid for eng in g.engines] + [g.router.process.pid]:
        assert process_group_members(pid) == []


def test_engine_group_refuses_a_model_dir_it_cannot_see_before_launching(tmp_path):
    from slime.utils.paths import PathNotVisibleError

    absent = tmp_path / "absent"
    absent.mkdir()
    args = _args(absent, str(tmp_path))
    absent.rmdir()  # as on an engine's node without the shared storage the driver saw
    g = EngineGroup(args, log_dir=str(tmp_path / "logs"), startup_timeout=60)
    with pytest.raises(PathNotVisibleError, match=r"engine 0 on node \S+: --hf-checkpoint .*absent: not found"):
        g.start()
    assert g.engines and g.engines[0].problem() is None  # no server was started
    assert not g.router.process.is_alive() and process_group_members(g.router.process.pid) == []


def test_shutdown_leaves_no_child_processes(group):
    pids = [e.pid for e in group.engines] + [group.router.process.pid]
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    group.shutdown()
    for p in pids:
        assert process_group_members(p) == [], f"process group {p} still has members"
    me = str(os.getpid())
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            rest = stat[stat.rfind(")") + 2:].split()
            if rest[1] == me and rest[0] != "Z":
                children.append((entry, open(f"/proc/{entry}/cmdline").read().replace("\0", " ")))
    # (tests/sglang_real_server.py processes belong to the SGLang contract tests' fixture, which may share this
    # pytest worker: they are not the group's)
    assert not [c for c in children if ("hf_engine" in c[1] or "sglang" in c[1]) and "sglang_real_server.py" not in c[1]], children
    with pytest.raises(Exception):
        requests.get(group.router_url + "/workers", timeout=2)
