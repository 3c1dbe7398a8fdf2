"""sglang-router launcher against the real sglang-router 0.3.2 binary (no engine needed)."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import requests

from slime.backends.sglang_utils.process_utils import ServerLaunchError, pick_free_ports, process_group_members
from slime.backends.sglang_utils.router import Router, build_router_command


def flag_value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_router_command_binds_loopback_and_uses_policy(base_args):
    cmd = build_router_command(base_args, "127.0.0.1", 31000, 31001)
    assert cmd[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    assert flag_value(cmd, "--host") == "127.0.0.1" and flag_value(cmd, "--prometheus-host") == "127.0.0.1"
    assert flag_value(cmd, "--port") == "31000" and flag_value(cmd, "--prometheus-port") == "31001"
    assert flag_value(cmd, "--policy") == "round_robin"
    assert "--disable-circuit-breaker" in cmd  # 0.3.2's flag (see `launch_router --help`)
    cmd = build_router_command(base_args.replace(sglang_router_policy="cache_aware"), "10.1.2.3", 1, 2)
    assert flag_value(cmd, "--policy") == "cache_aware" and flag_value(cmd, "--host") == "10.1.2.3"
    with pytest.raises(ValueError, match="--sglang-router-policy"):
        build_router_command(base_args.replace(sglang_router_policy="fastest"), "127.0.0.1", 1, 2)


@pytest.fixture(scope="module")
def router(tmp_path_factory, base_args):
    port, prom = pick_free_ports(2)
    r = Router.start(base_args, port, prom, str(tmp_path_factory.mktemp("router_logs")), timeout=60)
    yield r
    r.shutdown()


def test_router_listens_only_on_loopback(router):
    port = int(router.url.rsplit(":", 1)[1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in open(table).read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    addr, p = local.rsplit(":", 1)
                    if int(p, 16) == port:
                        listening.add(addr)
    assert listening == {"0100007F"}, listening  # 127.0.0.1 only
    assert router.list_workers() == []


def test_unreachable_worker_error_names_it_with_router_log(router):
    dead = f"http://127.0.0.1:{pick_free_ports(1)[0]}"
    router.add_worker(dead)
    with pytest.raises(ServerLaunchError) as e:  # nothing listens there: only the 3 s deadline ends the wait
        router.wait_workers_healthy([dead], timeout=3)
    msg = str(e.value)
    assert dead in msg and "not listed" in msg and "sglang-router" in msg and "as healthy within 3s" in msg
    assert dead in msg.split("last lines of its log:", 1)[1]  # the router's own log tail mentions the failing worker
    assert "\x1b[" not in msg


def test_attach_to_existing_router(router):
    other = Router.attach(router.url, timeout=5)
    assert not other.owned and other.list_workers() == router.list_workers()
    other.shutdown()  # an external router is never ours to stop
    assert requests.get(router.url + "/workers", timeout=5).status_code == 200
    with pytest.raises(ServerLaunchError, match="did not answer GET /workers"):
        Router.attach(f"http://127.0.0.1:{pick_free_ports(1)[0]}", timeout=2)


def test_dead_router_error_says_so_with_log_tail(tmp_path, base_args):
    port, prom = pick_free_ports(2)
    r = Router.start(base_args, port, prom, str(tmp_path), timeout=60)
    try:
        os.kill(r.process.pid, signal.SIGKILL)
        r.process.proc.wait(timeout=10)
        with pytest.raises(ServerLaunchError) as e:
            r.list_workers()
        assert "sglang-router" in str(e.value) and "exited with code -9" in str(e.value)
    finally:
        r.shutdown()
    assert process_group_members(r.process.pid) == []
