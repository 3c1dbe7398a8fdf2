"""Upstream slime's HTTP helpers for plugins: `await post(url, payload)` and `await get(url)`.

One connection per call (rollouts run on more than one event loop). Non-2xx raises `HTTPError`; connection
failures and 5xx are retried, a 4xx is not."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from slime.utils.redact import redact_url

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 3600.0  # one generate of a long response; connecting is bounded separately
CONNECT_TIMEOUT_S = 30.0
RETRY_DELAY_S = 1.0


class HTTPError(RuntimeError):
    def __init__(self, method: str, url: str, status: int, body: str):
        self.method, self.url, self.status, self.body = method, url, status, body
        super().__init__(f"{method} {redact_url(url)} -> HTTP {status}: {body[:2000]}")


async def _request(method: str, url: str, payload: Any, max_retries: int, headers: dict | None) -> Any:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    attempt = 0
    while True:
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.request(method, url, json=payload, headers=headers) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise HTTPError(method, url, resp.status, text)
                    return await resp.json(content_type=None) if text else None
        except HTTPError as e:
            if e.status < 500 or attempt >= max_retries:
                raise
            error: Exception = e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if attempt >= max_retries:
                raise ConnectionError(f"{method} {redact_url(url)}: no reply after {attempt + 1} tries: "
                                      f"{type(e).__name__}: {e}") from e
            error = e
        attempt += 1
        logger.info("%s %s failed (%s); retry %d/%d", method, redact_url(url), error, attempt, max_retries)
        await asyncio.sleep(RETRY_DELAY_S)


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict | None = None) -> Any:
    """POST `payload` as JSON to `url`; the decoded JSON reply."""
    return await _request("POST", url, payload, max_retries, headers)


async def get(url: str, max_retries: int = 0) -> Any:
    """GET `url`; the decoded JSON reply."""
    return await _request("GET", url, None, max_retries, None)
