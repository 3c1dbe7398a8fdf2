"""Listening sockets for the run's rendezvous stores and process groups, on `--listen-host` (loopback unless told
otherwise): torch's `TCPStore` and gloo would bind every interface, unauthenticated."""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket

WILDCARDS = ("", "0.0.0.0", "::")
AUTO = "auto"


class ListenHostError(ValueError):
    """`--listen-host` cannot be resolved on this node (an interface it does not have); names the node's interfaces."""


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


def is_ip_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their IPv4 (then IPv6) addresses."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address.split("%")[0] for a in addrs if a.family == socket.AF_INET6]
        if v4 or v6:
            out[name] = v4 + v6
    return out


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds `address` (None: no such interface here)."""
    for name, addrs in interface_addresses().items():
        if address in addrs:
            return name
    return None


def ray_node_ip() -> str | None:
    """This node's IP as Ray knows it (None outside a Ray job)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray here: the caller falls back
        return None


def ray_spans_machines() -> bool:
    """Whether the Ray cluster this process belongs to has alive nodes on more than one IP (False outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return False
        return len({n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}) > 1
    except Exception:  # noqa: BLE001 - no Ray here: one machine
        return False


def resolve_listen_host(listen_host: str) -> str:
    """The address this process's servers bind, from `--listen-host`: auto (loopback on one machine, else the Ray
    IP), localhost, an interface name, or an address."""
    if listen_host == AUTO:
        node_ip = ray_node_ip() if ray_spans_machines() else None
        return node_ip or "127.0.0.1"
    if listen_host == "localhost":
        return "127.0.0.1"
    if listen_host in WILDCARDS or is_ip_address(listen_host):
        return listen_host
    interfaces = interface_addresses()
    if listen_host in interfaces:
        return interfaces[listen_host][0]
    where = ray_node_ip() or socket.gethostname()
    raise ListenHostError(f"--listen-host {listen_host!r} is neither auto, an IP address nor an interface of node "
                          f"{where} (its interfaces: {', '.join(sorted(interfaces))})")


def source_address_towards(peer: str) -> str | None:
    """The local address this machine uses to reach `peer` (the routing table's choice; nothing is sent)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError:
        return None


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
    """The address a gloo device should listen on: loopback when the run is; the address it was told to listen
    on; with none (""), the local address that reaches `peer_address`; for a wildcard the default (hostname)."""
    if is_loopback(listen_host) or is_loopback(peer_address):
        return "127.0.0.1"
    if listen_host and listen_host not in WILDCARDS:
        return listen_host
    if listen_host == "" and peer_address:
        return source_address_towards(peer_address) or ""
    return ""


def pin_collectives_to_loopback() -> None:
    """Default process groups (gloo / NCCL bootstrap) listen on loopback, unless the user chose an interface."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def pin_collectives(local_address: str) -> None:
    """Default process groups listen where this process's stores do (gloo's own default is often the wrong NIC);
    an explicit GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME wins."""
    if is_loopback(local_address):
        pin_collectives_to_loopback()
        return
    name = interface_of(local_address) if local_address not in WILDCARDS else None
    if name:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
