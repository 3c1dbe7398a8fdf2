"""Small HTTP helpers for SGLang-protocol engines and sglang-router: every call has a timeout; a non-2xx reply
raises `EngineHTTPError`, no reply `EngineUnreachableError`; a 2xx reply comes back parsed when JSON, as text when
the server says it is not (`/flush_cache`), None when empty."""

from __future__ import annotations

import asyncio
import json as _json
import logging
from typing import Any

import aiohttp
import orjson
import requests

from slime.utils.redact import redact_url

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
_BODY_PREVIEW = 2000


class EngineHTTPError(RuntimeError):
    """A non-2xx reply (or an unparsable body) from an engine or the router."""

    def __init__(self, method: str, url: str, status: int, body: str):
        self.method = method
        self.url = url
        self.status = status
        self.body = body
        super().__init__(f"{method} {redact_url(url)} -> HTTP {status}: {body[:_BODY_PREVIEW]}")

    @property
    def is_refusal(self) -> bool:
        """The server refused this request itself (a 4xx other than timeout / rate limit / unknown route)."""
        return 400 <= self.status < 500 and self.status not in (404, 408, 429)

    @property
    def message(self) -> str:
        """The server's own reason: SGLang's `{"error": {"message"}}` (or `{"message"}`), else the body."""
        try:
            body = _json.loads(self.body)
        except ValueError:
            return self.body[:_BODY_PREVIEW]
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message") if isinstance(err, dict) else None
        return str(msg if msg is not None else err)[:_BODY_PREVIEW]


class EngineUnreachableError(RuntimeError):
    """No reply at all: the request timed out, or the connection was refused or reset."""

    def __init__(self, method: str, url: str, cause: str):
        self.method, self.url, self.cause = method, url, cause
        super().__init__(f"{method} {redact_url(url)}: {cause}")


def join_url(base_url: str, path: str) -> str:
    return base_url.rstrip("/") + "/" + path.lstrip("/")


def _media(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def _is_json(content_type: str | None) -> bool:
    """Whether a reply may be JSON: it says so, or says nothing (SGLang's plain `Response`s carry no type)."""
    media = _media(content_type)
    return media in ("", "application/json") or media.endswith("+json")


def _decode(method: str, url: str, status: int, text: str, content_type: str | None = None) -> dict | list | str | None:
    if not 200 <= status < 300:
        raise EngineHTTPError(method, url, status, text)
    if not text.strip():
        return None
    if not _is_json(content_type):
        return text  # a plain-text reply
    try:
        return _json.loads(text)
    except ValueError as e:
        if not _media(content_type):
            return text  # untyped and not JSON: text (SGLang's /flush_cache: "Cache flushed. ...")
        raise EngineHTTPError(method, url, status, f"response is not JSON ({e}): {text}") from e


async def _request(session: aiohttp.ClientSession, method: str, url: str, json: Any, timeout: float | None):
    # orjson both ways: /generate bodies carry a token id (and back, a log-prob) per token
    kw = {} if json is None else {"data": orjson.dumps(json), "headers": {"Content-Type": "application/json"}}
    waited = timeout if timeout is not None else DEFAULT_TIMEOUT_S
    try:
        async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=waited), **kw) as resp:
            body = await resp.read()
            status = resp.status
            content_type = resp.headers.get("Content-Type")
    except asyncio.TimeoutError:
        raise EngineUnreachableError(method, url, f"no reply within {waited:g}s") from None
    except aiohttp.ClientError as e:
        raise EngineUnreachableError(method, url, f"{type(e).__name__}: {e}") from None
    if 200 <= status < 300 and body.strip() and _is_json(content_type):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # _decode names the URL and shows the body
    return _decode(method, url, status, body.decode("utf-8", errors="replace"), content_type)


async def generate(session: aiohttp.ClientSession, url: str, payload: dict, timeout: float | None = None) -> dict:
    """POST one (non-batch, non-streaming) `GenerateReqInput` to `{url}/generate`; returns the JSON reply."""
    if payload.get("stream"):
        raise ValueError("http_client.generate: streaming requests are not supported here (payload['stream'] is true)")
    out = await _request(session, "POST", join_url(url, "/generate"), payload, timeout)
    if not isinstance(out, dict):
        raise EngineHTTPError("POST", join_url(url, "/generate"), 200, f"expected a JSON object, got {out!r}")
    return out


async def post(session: aiohttp.ClientSession, base_url: str, path: str, json: Any = None,
               timeout: float | None = DEFAULT_TIMEOUT_S) -> dict | list | None:
    return await _request(session, "POST", join_url(base_url, path), json, timeout)


async def get(session: aiohttp.ClientSession, base_url: str, path: str,
              timeout: float | None = DEFAULT_TIMEOUT_S) -> dict | list | None:
    return await _request(session, "GET", join_url(base_url, path), None, timeout)


def post_json(url: str, json: Any = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict | list | str | None:
    resp = requests.post(url, json=json, timeout=timeout)
    return _decode("POST", url, resp.status_code, resp.text, resp.headers.get("Content-Type"))


def get_json(url: str, timeout: float = DEFAULT_TIMEOUT_S) -> dict | list | str | None:
    resp = requests.get(url, timeout=timeout)
    return _decode("GET", url, resp.status_code, resp.text, resp.headers.get("Content-Type"))
