"""Engine faults below the rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import aiohttp
import pytest
import requests

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.backends.sglang_utils.watchdog import EngineFaultError, EngineWatchdog, ProcessWatch
from slime.ray.restarts import RestartBudget
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module", params=["local", "placed"])
def engines(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_faults")
    build_tiny_qwen3(str(root / "model"), build_tokenizer(VOCAB),
                     TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, max_position_embeddings=512))
    write_dataset(str(root / "p.jsonl"), 4, seed=0)
    args = parse_args(["--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "p.jsonl"),
                       "--rm-type", "subtract_chain", "--rollout-batch-size", "1", "--num-rollout", "1",
                       "--rollout-backend", "embedded", "--run-dir", str(root / "run"),
                       "--rollout-health-check-interval", "1", "--rollout-health-check-timeout", "2"])
    slots, pgs = None, None
    if request.param == "placed":
        from slime.ray.placement_group import create_placement_groups, remove_placement_groups
        from slime.utils.run import init_ray

        init_ray(num_cpus=2)
        pgs = create_placement_groups(args, timeout_s=60)
        slots = pgs.engine_slots(args.num_engines, args.rollout_num_gpus_per_engine)
    group = EngineGroup(args, log_dir=str(root / "logs"), slots=slots).start()
    yield args, group
    servers = [e.pid for e in group.engines]
    group.shutdown()
    assert not [p for p in servers if _alive(p)], "an engine server outlived EngineGroup.shutdown"
    if pgs is not None:
        import ray

        remove_placement_groups(pgs)
        ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


LONG = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}


def test_watchdog_names_a_stopped_engine_and_the_step_does_not_wait(engines):
    args, group = engines
    pid = group.engines[0].pid

    cut_mid_request = []

    async def run():
        # no client timeout: a request on the stopped engine would hang until pytest's timeout, so only the
        # watchdog can end this step (no request timeout that would surface the fault later)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            async def generate_forever():
                while True:  # a step's requests on the engine
                    try:
                        async with session.post(group.router_url + "/generate", json=LONG) as r:
                            await r.read()
                    except asyncio.CancelledError:
                        cut_mid_request.append(True)
                        raise

            wd = EngineWatchdog(args, group, session).start()
            asyncio.get_running_loop().call_later(0.5, os.kill, pid, signal.SIGSTOP)
            try:
                with pytest.raises(EngineFaultError) as err:
                    await wd.guard(generate_forever())
            finally:
                await wd.stop()
            return err.value

    try:
        error = asyncio.run(run())
    finally:
        os.kill(pid, signal.SIGCONT)
    assert cut_mid_request == [True]  # the step's request on the stopped engine was cancelled, not waited out
    assert [f.rank for f in error.faults] == [0]
    assert f"engine 0 ({group.engine_urls[0]}) is stopped (pid {pid} in state T" in str(error)


def test_a_blocking_call_on_a_stopped_engine_fails_at_once_then_restart_brings_it_back(engines):
    args, group = engines
    old_url, pid = group.engine_urls[0], group.engines[0].pid
    result = {}

    def blocking_call():  # stands for a weight sync waiting on the engine
        try:
            # no timeout: only the watch killing the engine can end this call
            requests.post(old_url + "/generate", json=LONG, timeout=None)
            result["ok"] = True
        except requests.RequestException as e:
            result["error"] = e

    caller = threading.Thread(target=blocking_call, daemon=True)
    with ProcessWatch(group, on_fault=lambda f: group.faults.kill_engine(f.rank)) as watch:
        # stopped before the call, so the call cannot finish first on a fast box; the kernel still accepts
        # the connection, so the caller blocks exactly as on an engine that froze mid-request
        os.kill(pid, signal.SIGSTOP)
        caller.start()
        caller.join(timeout=300)  # a safety net only: the call has no timeout of its own
    assert not caller.is_alive(), "the blocking call on the stopped engine was never ended by the process watch"
    # it failed because the engine was killed (connection dropped), not by a timeout
    assert isinstance(result.get("error"), requests.ConnectionError), result
    assert not isinstance(result["error"], requests.Timeout), result
    assert "is stopped" in watch.faults[old_url].problem
    assert "exited with code" in group.faults.engine_problem(old_url)

    new_url = group.faults.restart_engine(0)
    assert new_url != old_url and group.faults.engine_problem(new_url) is None
    assert group.worker_urls() == [new_url]  # the dead one is off the router
    out = requests.post(group.router_url + "/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 3}},
                        timeout=60).json()
    assert len(out["output_ids"]) == 3 and out["meta_info"]["weight_version"] == "0"  # fresh weights: re-sync next


def test_weight_sync_on_a_freezing_engine_restarts_it_and_pushes_again(engines):
    """An engine frozen mid-push is killed at once, restarted, and the same version pushed to the fresh one."""
    from slime.ray.rollout import RolloutManager

    args, group = engines
    manager = object.__new__(RolloutManager)  # only the engine-fault parts: no data, buffer or rollout function
    manager.args = args.replace(use_fault_tolerance=True, max_engine_restarts=2)
    manager.engines, manager.restarts = group, RestartBudget(2)
    calls = []

    def update_weights(engines, version, flush_cache=True):
        urls = engines.worker_urls()
        calls.append((version, urls))
        if len(calls) == 1:
            os.kill(engines.engines[0].pid, signal.SIGSTOP)
            try:  # waits on the frozen engine, with no timeout: only the kill can end it
                requests.post(urls[0] + "/generate", json=LONG, timeout=None)
            except requests.RequestException as e:
                failures.append(e)
                raise
        return {"weight_sync_time_s": 0.0}

    failures = []
    trainer = type("Trainer", (), {"update_weights": staticmethod(update_weights)})()
    assert manager.push_weights(trainer, 7, flush_cache=True) == {"weight_sync_time_s": 0.0}
    # the first push ended because the frozen engine was killed (its connection dropped), never by a timeout
    assert len(failures) == 1 and isinstance(failures[0], requests.ConnectionError), failures
    assert not isinstance(failures[0], requests.Timeout), failures
    assert [v for v, _ in calls] == [7, 7] and calls[0][1] != calls[1][1]
    assert manager.restarts.counts["engine"] == 1 and group.faults.engine_problem(group.engine_urls[0]) is None


def test_a_placed_engine_is_owned_by_its_host_actor_and_dies_with_it(engines):
    """The server is a child of the host actor on its bundle (not of the driver)."""
    import ray

    args, group = engines
    if not group.placed:
        pytest.skip("engines hosted in this process")
    engine = group.engines[0]
    node = group.engine_nodes()[0]
    assert _parent(engine.pid) == node["pid"] != os.getpid() and node["server_pid"] == engine.pid
    assert node["node_id"] == group.slots[0].node_id and node["url"] == engine.url
    old_url, server = engine.url, engine.pid
    ray.kill(engine.actor)
    deadline = time.monotonic() + 30
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server)  # PR_SET_PDEATHSIG: the server went with its host
    deadline = time.monotonic() + 15
    while group.faults.engine_problem(old_url) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "host actor" in group.faults.engine_problem(old_url)
    new_url = group.faults.restart_engine(0)
    assert group.worker_urls() == [new_url] and group.faults.engine_problem(new_url) is None
    assert group.engine_nodes()[0]["node_id"] == group.slots[0].node_id
    out = requests.post(group.router_url + "/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}},
                        timeout=60).json()
    assert len(out["output_ids"]) == 2


def test_a_dead_router_is_named_then_restarted_on_its_port_with_the_engines_registered_again(engines):
    """SIGKILL the router under a request."""
    from slime.backends.sglang_utils import engine_api, http_client
    from slime.ray.rollout import RolloutManager

    args, group = engines
    if group.placed:
        pytest.skip("the router is the driver's child either way")
    url, old_pid, engine_url = group.router_url, group.router.process.pid, group.engine_urls[0]
    found = []

    async def run():
        async with aiohttp.ClientSession() as session:
            # not started: only the failed request asks (the periodic check would find the exit too)
            watchdog = EngineWatchdog(args, group, session, on_fault=found.append)
            generate = watchdog.explaining(http_client.generate)
            request = asyncio.ensure_future(generate(session, url, LONG, timeout=120))
            while not await engine_api.busy(session, engine_url):  # the request reached the engine
                assert not request.done(), "the request ended before it was seen on the engine"
                await asyncio.sleep(0.01)
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(http_client.EngineUnreachableError):
                await request
            await group.abort_all_until_idle(timeout=30, session=session)  # the engines, without the router
            assert await engine_api.busy(session, engine_url) == 0

    asyncio.run(run())
    assert [f.describe() for f in found] == [f"the sglang-router at {url} (pid {old_pid}) exited with code -9 "
                                             "(killed by SIGKILL)"]
    with pytest.raises(EngineFaultError, match=rf"sglang-router at {url} \(pid {old_pid}\) exited with code -9"):
        group.worker_urls()

    manager = object.__new__(RolloutManager)  # only the restart: no data, buffer or rollout function
    manager.engines, manager.restarts = group, RestartBudget(1)
    error = EngineFaultError(found[0].describe(), found)
    manager.args = args.replace(use_fault_tolerance=False)
    with pytest.raises(EngineFaultError, match=r"exited with code -9 \(killed by SIGKILL\) \(--use-fault-tolerance would restart it\)"):
        manager.restart_engines(error)
    manager.args = args.replace(use_fault_tolerance=True)
    assert manager.restart_engines(error) == []  # no engine restarted: they keep their weights
    assert manager.restarts.counts["router"] == 1 and group.faults.router_fault() is None
    assert group.router_url == url and group.router.process.pid != old_pid
    assert group.worker_urls() == [engine_url] and group.engine_urls == [engine_url]
    out = requests.post(url + "/generate", json={"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 3}},
                        timeout=60).json()
    assert len(out["output_ids"]) == 3
    with pytest.raises(EngineFaultError, match=r"giving up after 1 restart\(s\) \(--max-engine-restarts 1"):
        manager.restart_engines(error)  # the budget is spent


def test_a_router_dead_before_the_weight_push_is_restarted_and_the_push_repeated(engines):
    """The router dies between two steps."""
    from slime.ray.rollout import RolloutManager, _faults_within

    args, group = engines
    if group.placed:
        pytest.skip("the router is the driver's child either way")
    old_pid = group.router.process.pid
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while group.faults.router_fault() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    # the watch's own thread recorded the exit first: the push's error handler must still see it
    watch = ProcessWatch(group)
    assert [f.url for f in watch.check()] == [group.router_url]
    assert [f.url for f in _faults_within(watch, 0.5)] == [group.router_url]

    manager = object.__new__(RolloutManager)  # only the engine-fault parts: no data, buffer or rollout function
    manager.args = args.replace(use_fault_tolerance=True, max_engine_restarts=2)
    manager.engines, manager.restarts = group, RestartBudget(2)
    calls = []

    def update_weights(engines, version, flush_cache=True):
        calls.append(version)
        return {"weight_sync_time_s": 0.0, "workers": engines.worker_urls()}

    trainer = type("Trainer", (), {"update_weights": staticmethod(update_weights)})()
    assert manager.push_weights(trainer, 7, flush_cache=True)["workers"] == group.engine_urls
    assert calls == [7, 7] and manager.restarts.counts["router"] == 1
    assert group.faults.router_fault() is None and group.router.process.pid != old_pid
