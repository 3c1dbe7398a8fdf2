"""aiohttp helpers shared by the engine's route modules: the app key, JSON replies, strict body fields."""

from __future__ import annotations

import orjson
from aiohttp import web

from slime.backends.hf_engine.engine import Engine
from slime.backends.hf_engine.fields import BadRequest
from slime.utils.sglang_versions import SGLANG_PINNED

ENGINE_KEY = web.AppKey("engine", Engine)
SERVER_VERSION = SGLANG_PINNED  # the SGLang version whose HTTP API we serve, reported where SGLang reports its own


def json_response(obj, status: int = 200) -> web.Response:
    """A JSON reply serialised with orjson: a /generate reply carries a log-prob per token, and the stdlib
    encoder (~2 us a float) made draining 100 aborted requests cost ~75 ms of engine time."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def error_response(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message, "code": status}}, status=status)


def result_response(success: bool, message: str, **extra) -> web.Response:
    return json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def json_body(request: web.Request, required: bool = True) -> dict:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise BadRequest("body: expected a JSON object")
        return {}
    try:
        body = orjson.loads(raw)
    except ValueError as e:
        raise BadRequest(f"body: malformed JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    return body


def body_field(body: dict, name: str, kind, default=..., allow_none=False):
    """`body[name]`, which must be a `kind` (a JSON boolean for bool: "no" is refused, not truthy)."""
    if name not in body or (body[name] is None and default is not ...):
        if default is ...:
            raise BadRequest(f"{name}: missing")
        return default
    v = body[name]
    if v is None and allow_none:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool)):
        raise BadRequest(f"{name}: expected {'/'.join(k.__name__ for k in kinds)}, got {v!r}")
    return v


@web.middleware
async def bad_request_middleware(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(400, str(e))
