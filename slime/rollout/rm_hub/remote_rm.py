"""`--rm-type remote_rm`: POST `{"prompt", "response", "label"}` to `--rm-url`, read back a number (bare, or an
object's `"reward"` / `"score"`); anything else is an error naming the URL."""

from __future__ import annotations

import json
import math

import aiohttp

from slime.utils.redact import redact_url


def _reward_from_json(body, url: str) -> float:
    if isinstance(body, dict):
        for key in ("reward", "score"):
            if key in body:
                body = body[key]
                break
        else:
            raise ValueError(f"remote reward model {url} answered an object without 'reward'/'score': {str(body)[:200]}")
    if isinstance(body, bool) or not isinstance(body, (int, float)):
        raise ValueError(f"remote reward model {url} answered a non-number: {str(body)[:200]}")
    value = float(body)
    if not math.isfinite(value):
        raise ValueError(f"remote reward model {url} answered {value}")
    return value


async def remote_rm(args, sample, timeout: float | None = None, response: str | None = None) -> float:
    """POST the sample to `args.rm_url`, return its reward (`response`: instead of `sample.response`)."""
    url = args.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url")
    shown = redact_url(url)  # error messages end up in logs and sample metadata
    payload = {"prompt": sample.prompt, "response": sample.response if response is None else response, "label": sample.label}
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        async with session.post(url, json=payload) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise RuntimeError(f"remote reward model {shown} returned HTTP {resp.status}: {text[:200]}")
            try:
                body = json.loads(text)
            except ValueError as e:
                raise ValueError(f"remote reward model {shown} returned invalid JSON: {text[:200]}") from e
    return _reward_from_json(body, shown)
