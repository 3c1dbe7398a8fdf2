"""Unit tests for slime/backends/sglang_utils that need no engine."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time

import aiohttp
import pytest
from aiohttp import web

from slime.arguments import parse_args
from slime.backends.sglang_utils import http_client, sglang_engine
from slime.backends.sglang_utils.engine_api import busy_requests, running_capacity
from slime.backends.sglang_utils.process_utils import (
    ManagedProcess,
    ServerLaunchError,
    pick_free_ports,
    process_group_members,
)
from slime.backends.sglang_utils.sglang_engine import (
    build_embedded_engine_command,
    build_sglang_server_command,
    resolve_rollout_backend,
)


def make_args(tmp_path, *extra):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.touch()
    return parse_args(["--hf-checkpoint", str(model), "--prompt-data", str(prompts), "--rm-type", "math",
                       "--num-rollout", "1", "--rollout-batch-size", "2", *extra])


def flag_value(cmd, flag):
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    return cmd[cmd.index(flag) + 1]


# --- command builders ----------------------------------------------------------------
def test_sglang_command_sets_our_flags_and_passes_user_flags_through(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIME_SGLANG_PYTHON", raising=False)  # --sglang-python's default: this interpreter
    args = make_args(tmp_path, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2", "--seed", "7",
                     "--sglang-mem-fraction-static", "0.8", "--sglang-enable-memory-saver",
                     "--sglang-log-level=warning")
    cmd = build_sglang_server_command(args, engine_rank=1, port=31001, nccl_port=32001, base_gpu_id=2)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag_value(cmd, "--model-path") == str(tmp_path / "model")
    assert flag_value(cmd, "--tp-size") == "2"
    assert flag_value(cmd, "--host") == "127.0.0.1"
    assert flag_value(cmd, "--port") == "31001"
    assert flag_value(cmd, "--base-gpu-id") == "2"
    assert flag_value(cmd, "--nccl-port") == "32001"
    assert flag_value(cmd, "--random-seed") == "8"  # seed + engine rank
    assert flag_value(cmd, "--weight-version") == "0"
    assert flag_value(cmd, "--mem-fraction-static") == "0.8"
    assert flag_value(cmd, "--log-level") == "warning"
    i = cmd.index("--enable-memory-saver")  # a boolean flag: no value after it
    assert i == len(cmd) - 1 or cmd[i + 1].startswith("--")


def test_sglang_command_user_host_seed_and_version_replace_defaults(tmp_path):
    args = make_args(tmp_path, "--sglang-host", "10.0.0.5", "--sglang-random-seed", "99", "--sglang-weight-version", "3")
    cmd = build_sglang_server_command(args, 0, 1, 2, 0)
    assert flag_value(cmd, "--host") == "10.0.0.5"
    assert flag_value(cmd, "--random-seed") == "99"
    assert flag_value(cmd, "--weight-version") == "3"


@pytest.mark.parametrize("flag,hint", [("--sglang-tp-size", "--rollout-num-gpus-per-engine"),
                                       ("--sglang-port", "picked automatically"),
                                       ("--sglang-model-path", "--hf-checkpoint")])
def test_sglang_command_rejects_flags_we_own(tmp_path, flag, hint):
    args = make_args(tmp_path, flag, "5")
    with pytest.raises(ValueError) as e:
        build_sglang_server_command(args, 0, 1, 2, 0)
    assert flag in str(e.value) and hint in str(e.value)


def test_embedded_command(tmp_path):
    args = make_args(tmp_path, "--embedded-engine-threads", "2", "--seed", "5")
    cmd = build_embedded_engine_command(args, engine_rank=3, port=40000)
    assert cmd[:3] == [sys.executable, "-m", "slime.backends.hf_engine"]
    assert flag_value(cmd, "--model-path") == str(tmp_path / "model")
    assert flag_value(cmd, "--host") == "127.0.0.1"
    assert flag_value(cmd, "--port") == "40000"
    assert flag_value(cmd, "--num-threads") == "2"
    assert flag_value(cmd, "--seed") == "8"


def test_embedded_command_passes_sglang_flags_it_knows_and_refuses_the_rest(tmp_path):
    args = make_args(tmp_path, "--sglang-disable-radix-cache", "--sglang-max-running-requests", "64")
    cmd = build_embedded_engine_command(args, engine_rank=0, port=40000)
    assert "--disable-radix-cache" in cmd and flag_value(cmd, "--max-running-requests") == "64"
    with pytest.raises(ValueError, match="--sglang-mem-fraction-static: the embedded engine"):
        build_embedded_engine_command(make_args(tmp_path, "--sglang-mem-fraction-static", "0.7"), 0, 40000)
    with pytest.raises(ValueError, match="--sglang-port cannot be passed through"):
        build_embedded_engine_command(make_args(tmp_path, "--sglang-port", "1"), 0, 40000)


def test_builders_name_the_missing_checkpoint_flag(base_args):
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        build_sglang_server_command(base_args.replace(hf_checkpoint=None), 0, 1, 2, 0)
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        build_embedded_engine_command(base_args.replace(hf_checkpoint=None), 0, 1)


def test_backend_choice(tmp_path, monkeypatch):
    assert resolve_rollout_backend(make_args(tmp_path, "--rollout-backend", "embedded")) == "embedded"
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: False)
    monkeypatch.setattr(sglang_engine, "_sglang_importable", lambda python=None: True)
    assert resolve_rollout_backend(make_args(tmp_path)) == "embedded"  # auto without CUDA
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: True)
    assert resolve_rollout_backend(make_args(tmp_path)) == "sglang"  # auto with CUDA + sglang
    monkeypatch.setattr(sglang_engine, "_sglang_importable", lambda python=None: False)
    assert resolve_rollout_backend(make_args(tmp_path)) == "embedded"
    with pytest.raises(RuntimeError, match="--rollout-backend sglang"):
        resolve_rollout_backend(make_args(tmp_path, "--rollout-backend", "sglang"))


def test_busy_requests_reads_sglang_load_shapes():
    # SGLang's /v1/loads?include=core: {"version", "loads": [a LoadSnapshot's core fields per DP rank]}
    v1 = {"timestamp": "t", "version": "0.5.23", "loads": [
        {"dp_rank": 0, "num_running_reqs": 2, "num_waiting_reqs": 1, "max_running_requests": 8},
        {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 0, "max_running_requests": 8}]}
    assert busy_requests(v1) == 6 and running_capacity(v1) == 16
    assert busy_requests({"version": "0.5.23", "loads": []}) == 0
    # the legacy /get_load (SGLang < 0.5.21): a list of per-DP-rank dicts
    assert busy_requests([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]) == 0
    assert busy_requests([{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 1}, {"dp_rank": 1, "num_reqs": 3}]) == 6
    assert running_capacity([{"num_reqs": 2}]) is None
    with pytest.raises(ValueError, match="per-DP-rank load dicts"):
        busy_requests(["nonsense"])


# --- HTTP client against a real local server -------------------------------------------
async def _serve(app):
    runner = web.AppRunner(app)
    await runner.setup()
    port = pick_free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _app():
    async def generate(request):
        body = await request.json()
        return web.json_response({"text": "", "output_ids": body["input_ids"][::-1], "meta_info": {"id": body.get("rid")}})

    async def empty(request):
        return web.Response(status=200, text="")

    async def fail(request):
        return web.Response(status=503, text="engine is paused")

    async def echo(request):
        return web.json_response({"method": request.method, "body": await request.json() if request.can_read_body else None})

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", empty)
    app.router.add_route("*", "/fail", fail)
    app.router.add_route("*", "/echo", echo)
    return app


def test_async_client_shapes_and_errors():
    async def main():
        runner, url = await _serve(_app())
        try:
            async with aiohttp.ClientSession() as s:
                out = await http_client.generate(s, url, {"input_ids": [1, 2, 3], "rid": "r1"}, timeout=5)
                assert out["output_ids"] == [3, 2, 1] and out["meta_info"]["id"] == "r1"
                assert await http_client.post(s, url, "/abort_request", {"abort_all": True}) is None
                assert await http_client.post(s, url + "/", "echo", {"a": 1}) == {"method": "POST", "body": {"a": 1}}
                assert (await http_client.get(s, url, "/echo"))["method"] == "GET"
                with pytest.raises(http_client.EngineHTTPError) as e:
                    await http_client.post(s, url, "/fail", {})
                assert e.value.status == 503 and e.value.body == "engine is paused"
                assert e.value.url == url + "/fail" and url + "/fail" in str(e.value)
                with pytest.raises(ValueError, match="stream"):
                    await http_client.generate(s, url, {"input_ids": [1], "stream": True})
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_sync_client_against_server_in_thread():
    import threading

    ready, box = threading.Event(), {}

    def serve():
        loop = asyncio.new_event_loop()
        box["runner"], box["url"] = loop.run_until_complete(_serve(_app()))
        box["loop"] = loop
        ready.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    url = box["url"]
    try:
        assert http_client.post_json(url + "/echo", {"x": [1]}, timeout=5) == {"method": "POST", "body": {"x": [1]}}
        assert http_client.get_json(url + "/echo", timeout=5)["method"] == "GET"
        assert http_client.post_json(url + "/abort_request", {"rid": "a"}, timeout=5) is None
        with pytest.raises(http_client.EngineHTTPError) as e:
            http_client.get_json(url + "/fail", timeout=5)
        assert e.value.status == 503 and "engine is paused" in str(e.value) and url + "/fail" in str(e.value)
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(5)


# --- processes ------------------------------------------------------------------------
def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_pick_free_ports_distinct_and_excluding():
    first = pick_free_ports(4)
    assert len(set(first)) == 4
    second = pick_free_ports(4, exclude=set(first))
    assert not set(first) & set(second)
    # SGLang 0.5.15.post1 refuses a server port above 55535 (it reserves port + 10000): ports under a bound,
    # below the OS's ephemeral range here, come from the scan
    low = pick_free_ports(3, exclude=set(first), max_port=30000)
    assert len(set(low)) == 3 and all(p <= 30000 for p in low) and not set(low) & set(first)


def test_dead_server_error_names_it_and_shows_log_tail(tmp_path):
    proc = ManagedProcess("engine 7 (embedded)", _py("import sys; print('boom: bad model path /nope', flush=True); sys.exit(3)"),
                          str(tmp_path / "e.log")).start()
    with pytest.raises(ServerLaunchError) as e:
        proc.wait_http_ok("http://127.0.0.1:9/health_generate", timeout=30)
    msg = str(e.value)
    assert "engine 7 (embedded)" in msg and "exited with code 3" in msg and "boom: bad model path /nope" in msg


def test_silent_server_times_out_with_log_tail(tmp_path):
    port = pick_free_ports(1)[0]
    # silent for longer than this test may run: only wait_http_ok's own deadline can end the wait
    proc = ManagedProcess("engine 0", _py("import time; print('loading weights...', flush=True); time.sleep(3600)"),
                          str(tmp_path / "e.log")).start()
    try:
        with pytest.raises(ServerLaunchError) as e:
            proc.wait_http_ok(f"http://127.0.0.1:{port}/health_generate", timeout=1.5)
        assert "engine 0" in str(e.value) and "within 2s" in str(e.value) and "loading weights..." in str(e.value)
        assert "exited" not in str(e.value) and proc.is_alive()  # the deadline fired, not the server's exit
    finally:
        proc.terminate(grace=2)
    assert not proc.is_alive()


def test_terminate_kills_the_whole_group_even_if_sigterm_is_ignored(tmp_path):
    # the server ignores SIGTERM and has a grandchild: both must be gone after terminate()
    code = """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)'])
        print('child', child.pid, flush=True)
        time.sleep(3600)
    """
    log = tmp_path / "s.log"
    proc = ManagedProcess("stubborn", _py(code), str(log)).start()
    deadline = time.monotonic() + 20
    while "child" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(log.read_text().split()[1])
    assert set(process_group_members(proc.pid)) >= {proc.pid, grandchild}
    # both ignore SIGTERM and sleep longer than this test may run: only terminate's SIGKILL after the grace
    # period can end them
    proc.terminate(grace=0.5)
    assert not proc.is_alive() and proc.returncode() == -signal.SIGKILL
    assert process_group_members(proc.pid) == []
    assert not os.path.exists(f"/proc/{grandchild}") or open(f"/proc/{grandchild}/stat").read().split()[2] == "Z"


def test_make_engine_process_env_and_urls(tmp_path, monkeypatch):
    args = make_args(tmp_path, "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: True)  # a GPU machine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what Ray gives an actor that asked for no GPU
    eng = sglang_engine.make_engine_process(args, "sglang", 1, 31000, str(tmp_path), nccl_port=31001)
    assert "CUDA_VISIBLE_DEVICES" not in eng.process._env
    assert flag_value(eng.process.cmd, "--base-gpu-id") == "2" and eng.url == "http://127.0.0.1:31000"
    assert eng.process.log_path == str(tmp_path / "engine_1.log")
    with pytest.raises(ValueError, match="nccl_port"):
        sglang_engine.make_engine_process(args, "sglang", 0, 31000, str(tmp_path))
    emb = sglang_engine.make_engine_process(args, "embedded", 0, 32000, str(tmp_path))
    assert emb.process._env["OMP_NUM_THREADS"] and emb.url == "http://127.0.0.1:32000"
    with pytest.raises(ValueError, match="rollout backend"):
        sglang_engine.make_engine_process(args, "vllm", 0, 1, str(tmp_path))


def test_children_die_with_a_killed_parent(tmp_path):
    # a trainer killed with SIGKILL runs no atexit: PR_SET_PDEATHSIG must still take its servers down
    code = f"""
        import sys, time
        from slime.backends.sglang_utils.process_utils import ManagedProcess
        p = ManagedProcess('srv', [sys.executable, '-c', 'import time; time.sleep(120)'], {str(tmp_path / 's.log')!r}).start()
        print(p.pid, flush=True)
        time.sleep(120)
    """
    import subprocess

    parent = subprocess.Popen(_py(code), stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert os.path.exists(f"/proc/{child}")
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while process_group_members(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_group_members(child) == []


def test_colocated_engines_are_launched_with_the_memory_saver(tmp_path, monkeypatch):
    """--colocate with SGLang engines."""
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: True)
    monkeypatch.setattr(sglang_engine, "_sglang_importable", lambda python=None: True)
    colo = make_args(tmp_path, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2")
    assert resolve_rollout_backend(colo) == "sglang"  # no longer refused
    cmd = build_sglang_server_command(colo, 1, 31001, 32001, base_gpu_id=2)
    assert cmd.count("--enable-memory-saver") == 1 and cmd[cmd.index("--tp-size") + 1] == "2"
    assert "--enable-memory-saver" not in build_sglang_server_command(make_args(tmp_path), 0, 1, 2, 0)
    from slime.backends.sglang_utils.sglang_engine import build_embedded_engine_command

    assert "--enable-memory-saver" in build_embedded_engine_command(make_args(tmp_path, "--colocate"), 0, 1)
    assert "--enable-memory-saver" not in build_embedded_engine_command(make_args(tmp_path), 0, 1)


def test_sglang_on_a_cpu_box_runs_from_its_interpreter_with_the_cpu_flags_and_stand_ins(tmp_path, monkeypatch):
    """No CUDA: SGLang runs from --sglang-python with our CPU flags (user-overridable) and the import stand-ins."""
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: False)
    monkeypatch.setenv("SLIME_SGLANG_PYTHON", "/opt/sglang-venv/bin/python")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    args = make_args(tmp_path, "--sglang-dtype", "bfloat16", "--sglang-max-total-tokens=4096")
    assert args.sglang_python == "/opt/sglang-venv/bin/python"
    eng = sglang_engine.make_engine_process(args, "sglang", 0, 31000, str(tmp_path), nccl_port=31001)
    cmd, env = eng.process.cmd, eng.process._env
    assert cmd[:3] == ["/opt/sglang-venv/bin/python", "-m", "sglang.launch_server"]
    assert flag_value(cmd, "--device") == "cpu" and flag_value(cmd, "--attention-backend") == "torch_native"
    assert flag_value(cmd, "--sampling-backend") == "pytorch" and flag_value(cmd, "--grammar-backend") == "none"
    assert "--disable-cuda-graph" in cmd and "--skip-server-warmup" in cmd
    assert flag_value(cmd, "--dtype") == "bfloat16" and flag_value(cmd, "--max-total-tokens") == "4096"
    assert env["PYTHONPATH"].split(os.pathsep) == [sglang_engine.CPU_STAND_INS, "/somewhere"]
    assert env["SGLANG_USE_CPU_ENGINE"] == "0"
    assert os.path.exists(os.path.join(sglang_engine.CPU_STAND_INS, "vllm", "_custom_ops.py"))
    # SGLang on CPU takes the GPU id for a NUMA node (engine 1 at --base-gpu-id 1 asserted on a 1-node box)
    second = sglang_engine.make_engine_process(args, "sglang", 1, 31002, str(tmp_path), nccl_port=31003)
    assert flag_value(second.process.cmd, "--base-gpu-id") == "0"
    with pytest.raises(ValueError, match="--colocate"):
        sglang_engine.make_engine_process(make_args(tmp_path, "--colocate"), "sglang", 0, 1, str(tmp_path), nccl_port=2)
    monkeypatch.setattr(sglang_engine, "_cuda_available", lambda: True)  # a GPU: none of it
    gpu = sglang_engine.make_engine_process(make_args(tmp_path), "sglang", 0, 31000, str(tmp_path), nccl_port=31001)
    assert "--device" not in gpu.process.cmd and gpu.process._env.get("PYTHONPATH") == "/somewhere"


def test_sglang_backend_names_the_interpreter_that_cannot_import_it(tmp_path):
    """An interpreter without sglang: --rollout-backend sglang with it is refused, naming the flag and the fix."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # every import fails
    python.chmod(0o755)
    args = make_args(tmp_path, "--rollout-backend", "sglang", "--sglang-python", str(python))
    with pytest.raises(RuntimeError, match=r"--sglang-python .* cannot import `sglang`.*sglang_cpu_env.py install"):
        resolve_rollout_backend(args)
