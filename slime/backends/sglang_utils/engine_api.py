"""What we read from an engine's server, as SGLang reports it: its load (`/v1/loads`, `/get_load` where that
is missing), its scheduler idle time (the embedded engine's `/get_server_info`) and its version."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp

from slime.backends.sglang_utils import http_client
from slime.utils import sglang_versions as versions

LOADS_PATH = "/v1/loads?include=core"
LEGACY_LOAD_PATH = "/get_load"
SERVER_INFO_PATH = "/server_info"
LEGACY_SERVER_INFO_PATH = "/get_server_info"


class UnsupportedEngineVersion(RuntimeError):
    """An engine answers an SGLang version outside the supported range (the message names both)."""


def _rank_loads(reply: Any, where: str) -> list[dict]:
    """The per-DP-rank dicts of a /v1/loads reply, or of a legacy /get_load reply (a list, or one dict)."""
    items = reply.get("loads") if isinstance(reply, dict) and "loads" in reply else reply
    items = items if isinstance(items, list) else [items]
    if not all(isinstance(i, dict) for i in items):
        raise ValueError(f"{where}: expected per-DP-rank load dicts, got {reply!r}")
    return items


def running_and_waiting(reply: Any, where: str = "load") -> tuple[int, int]:
    """(running, waiting) requests summed over the DP ranks of one server's load reply."""
    running = waiting = 0
    for item in _rank_loads(reply, where):
        running += int(item.get("num_running_reqs", item.get("num_reqs", 0)) or 0)
        waiting += int(item.get("num_waiting_reqs", 0) or 0)
    return running, waiting


def running_capacity(reply: Any, where: str = "load") -> int | None:
    """The decode-batch capacity (`max_running_requests` summed over ranks), None where a rank does not say."""
    caps = [item.get("max_running_requests") for item in _rank_loads(reply, where)]
    return sum(int(c) for c in caps) if caps and all(c for c in caps) else None


def busy_requests(reply: Any, where: str = "load") -> int:
    return sum(running_and_waiting(reply, where))


async def load(session: aiohttp.ClientSession, url: str, timeout: float | None = 10.0, include: str = "core") -> Any:
    """One server's load reply: /v1/loads?include=<include>, or /get_load on a server without it (404)."""
    try:
        return await http_client.get(session, url, f"/v1/loads?include={include}", timeout=timeout)
    except http_client.EngineHTTPError as e:
        if e.status != 404:
            raise
    return await http_client.get(session, url, LEGACY_LOAD_PATH, timeout=timeout)


def _get_or_legacy(url: str, path: str, legacy: str, timeout: float) -> Any:
    """GET `path`, or `legacy` on a server without it (404)."""
    try:
        return http_client.get_json(http_client.join_url(url, path), timeout)
    except http_client.EngineHTTPError as e:
        if e.status != 404:
            raise
    return http_client.get_json(http_client.join_url(url, legacy), timeout)


def load_sync(url: str, timeout: float = 10.0) -> Any:
    return _get_or_legacy(url, LOADS_PATH, LEGACY_LOAD_PATH, timeout)


async def busy(session: aiohttp.ClientSession, url: str, timeout: float | None = 10.0) -> int:
    """Running + waiting requests on one server."""
    return busy_requests(await load(session, url, timeout), url)


def server_info(url: str, timeout: float = 10.0) -> dict:
    out = _get_or_legacy(url, SERVER_INFO_PATH, LEGACY_SERVER_INFO_PATH, timeout)
    if not isinstance(out, dict):
        raise http_client.EngineHTTPError("GET", http_client.join_url(url, SERVER_INFO_PATH), 200,
                                          f"expected a JSON object, got {out!r}")
    return out


def engine_version(url: str, timeout: float = 10.0) -> str:
    version = server_info(url, timeout).get("version")
    if not isinstance(version, str) or not version:
        raise UnsupportedEngineVersion(f"{url}/server_info reports no SGLang version ({version!r}); this run "
                                       f"needs an engine speaking the API of {versions.supported_range()}")
    return version


def check_engine_versions(urls: list[str], timeout: float = 10.0) -> dict[str, str]:
    """Every engine's SGLang version, by URL; raises naming each one outside the supported range."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
        found = dict(zip(urls, pool.map(lambda u: engine_version(u, timeout), urls)))
    bad = {u: v for u, v in found.items() if not versions.is_supported(v)}
    if bad:
        raise UnsupportedEngineVersion(
            "; ".join(f"{u} runs SGLang {v}" for u, v in bad.items())
            + f": this version of slime-april supports {versions.supported_range()} (the pins in "
              f"slime/utils/sglang_versions.py); run a supported SGLang")
    return found


async def gather_loads(session: aiohttp.ClientSession, urls: list[str], timeout: float | None = 10.0,
                       include: str = "core") -> list[Any]:
    return list(await asyncio.gather(*(load(session, u, timeout, include) for u in urls)))


async def rank_loads(session: aiohttp.ClientSession, urls: list[str], timeout: float | None = 10.0) -> list[dict]:
    """Every server's per-DP-rank load dicts with their queues, flattened (what --admission auto reads)."""
    replies = await gather_loads(session, urls, timeout, include="core,queues")
    return [rank for u, reply in zip(urls, replies) for rank in _rank_loads(reply, u)]


def engine_idle_seconds(urls: list[str], timeout: float = 10.0) -> float | None:
    """The engines' scheduler idle seconds so far, summed (None if one has no such counter)."""
    total = 0.0
    for url in urls:
        info = http_client.get_json(url.rstrip("/") + "/get_server_info", timeout=timeout)
        states = info.get("internal_states") if isinstance(info, dict) else None
        stats = states[0].get("scheduler_stats") if isinstance(states, list) and states and isinstance(states[0], dict) else None
        if not isinstance(stats, dict) or "idle_s" not in stats:
            return None
        total += float(stats["idle_s"])
    return total
