"""The rendezvous store and gloo listen on loopback only (torch's own store server would bind every interface)."""

import datetime
import ipaddress

import psutil
import torch

from slime.utils.net import advertised_address, gloo_bind_host, gloo_group, is_loopback, listen_socket, serve_store


def _listeners() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


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
