"""The rendezvous store and gloo listen on loopback only (torch's own store server would bind every interface)."""

import datetime
import ipaddress
import os

import psutil
import torch

from slime.utils.net import advertised_address, gloo_bind_host, is_loopback, listen_socket, serve_store


def _listeners() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta, bind_host: str):
    """A `ProcessGroupGloo` whose device listens on `bind_host`."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def test_store_and_gloo_group_listen_on_loopback_only():
    before = _listeners()
    sock = listen_socket("127.0.0.1")
    port = sock.getsockname()[1]
    timeout = datetime.timedelta(seconds=30)
    store = serve_store(sock, 1, timeout)
    store.set("k", "v")
    assert store.get("k") == b"v" and store.port == port
    pg = gloo_group(store, 0, 1, timeout, gloo_bind_host("127.0.0.1", "127.0.0.1"))
    t = torch.ones(3)
    pg.broadcast(t, 0).wait()
    new = _listeners() - before
    assert new, "the store and gloo should be listening"
    assert port in {p for _, p in new}
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in new), new
    pg.shutdown()


def test_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    assert advertised_address("127.0.0.1") == "127.0.0.1" and advertised_address("10.1.2.3") == "10.1.2.3"
    assert gloo_bind_host("0.0.0.0", "10.1.2.3") == "" and gloo_bind_host("", "127.0.0.1") == "127.0.0.1"


def test_listen_host_is_resolved_on_each_node(monkeypatch):
    import pytest

    from slime.utils import net

    assert net.resolve_listen_host("auto") == "127.0.0.1"  # one machine (no Ray, or every node on one IP)
    assert net.resolve_listen_host("localhost") == "127.0.0.1" == net.resolve_listen_host("lo")
    assert net.resolve_listen_host("10.1.2.3") == "10.1.2.3" and net.resolve_listen_host("0.0.0.0") == "0.0.0.0"
    with pytest.raises(net.ListenHostError, match=r"'eth-nope' is neither auto.*its interfaces: .*lo"):
        net.resolve_listen_host("eth-nope")
    # a cluster that spans machines: auto is this node's IP as Ray knows it
    monkeypatch.setattr(net, "ray_spans_machines", lambda: True)
    monkeypatch.setattr(net, "ray_node_ip", lambda: "10.0.0.7")
    assert net.resolve_listen_host("auto") == "10.0.0.7"
    assert net.resolve_listen_host("127.0.0.1") == "127.0.0.1"  # an explicit address stays


def test_interfaces_routes_and_collective_pinning():
    from unittest import mock

    from slime.utils import net

    assert net.interface_of("127.0.0.1") == "lo" and net.interface_of("203.0.113.9") is None
    assert net.source_address_towards("127.0.0.1") == "127.0.0.1"
    assert gloo_bind_host("10.1.2.3", "10.9.9.9") == "10.1.2.3"  # a node's own address, not the hostname's
    others = {name: addrs[0] for name, addrs in net.interface_addresses().items() if name != "lo"}
    with mock.patch.dict(os.environ):  # restored afterwards, set or not
        for name, address in list(others.items())[:1]:
            assert net.resolve_listen_host(name) == address and net.interface_of(address) == name
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
            net.pin_collectives(address)
            assert os.environ["GLOO_SOCKET_IFNAME"] == name
        os.environ["GLOO_SOCKET_IFNAME"] = "mine"
        os.environ.pop("NCCL_SOCKET_IFNAME", None)
        net.pin_collectives("127.0.0.1")
        assert os.environ["GLOO_SOCKET_IFNAME"] == "mine" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"  # user's wins
