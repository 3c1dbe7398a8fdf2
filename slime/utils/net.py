"""Listening sockets for the run's rendezvous stores and process groups, on loopback unless told otherwise.

torch's `TCPStore(host, port, is_master=True)` binds its server to every
interface whatever `host` says, and gloo binds where the machine's hostname
resolves. Both are unauthenticated. So the store's listening socket is
created here, bound to `--listen-host` (127.0.0.1 by default), and handed to
the store (`TCPStore(master_listen_fd=...)`); gloo devices are bound to the
same host. A multi-node run sets `--listen-host` to this node's interface
address (or 0.0.0.0); peers then connect to `advertised_address(...)`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

WILDCARDS = ("", "0.0.0.0", "::")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def advertised_address(listen_host: str) -> str:
    """The address peers connect to for a server listening on `listen_host`."""
    if is_loopback(listen_host):
        return "127.0.0.1"
    if listen_host in WILDCARDS:
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray: the hostname's address
            return socket.gethostbyname(socket.gethostname())
    return listen_host


def listen_socket(host: str, port: int = 0, backlog: int = 256) -> socket.socket:
    """A TCP socket bound to (`host`, `port`) and listening (port 0: pick a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(sock: socket.socket, world_size: int, timeout: datetime.timedelta, wait_for_workers: bool = True):
    """The master `TCPStore`, serving on `sock` (which it takes over: do not use `sock` afterwards)."""
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=sock.detach())


def gloo_bind_host(listen_host: str, peer_address: str) -> str:
    """The address a gloo device should listen on: loopback when the run is, else the default (hostname)."""
    return "127.0.0.1" if is_loopback(listen_host) or is_loopback(peer_address) else ""


def gloo_group(store, rank: int, world_size: int, timeout: datetime.timedelta, bind_host: str = ""):
    """A `ProcessGroupGloo` whose device listens on `bind_host` ("" = gloo's default, the hostname's address)."""
    import torch.distributed as dist

    if not bind_host:
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


def pin_collectives_to_loopback() -> None:
    """Default process groups (gloo / NCCL bootstrap) listen on loopback, unless the user chose an interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
