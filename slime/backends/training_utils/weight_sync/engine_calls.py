"""POSTs from a trainer rank to engine workers (weight sync), checked for SGLang's `success` field; a
failure names the worker and the route."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from slime.backends.sglang_utils.http_client import post_json


def post(url: str, path: str, payload: dict, timeout: float) -> dict:
    full = url.rstrip("/") + path
    out = post_json(full, payload, timeout=timeout)
    if isinstance(out, dict) and out.get("success") is False:
        raise RuntimeError(f"POST {full} failed: {out.get('message')}")
    return out or {}


def post_all(pool: ThreadPoolExecutor, urls: list[str], path: str, payload: dict, timeout: float):
    return [pool.submit(post, u, path, payload, timeout) for u in urls]


def wait_all(futures, urls: list[str], path: str, timeout: float) -> list[dict]:
    out = []
    for fut, url in zip(futures, urls):
        try:
            out.append(fut.result(timeout=timeout))
        except Exception as e:
            raise RuntimeError(f"weight update: {path} on worker {url} failed: {e}") from e
    return out
