"""The embedded engine's weight-update routes, as SGLang 0.5.23 serves them (`/update_weights_from_*`,
`/begin_weight_update` / `/end_weight_update`, the weight-update group's routes, `/update_weight_version`).
Outside a session a tensor or broadcast update is refused (400, SGLang's message) and nothing is touched.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from slime.backends.hf_engine.engine import Engine, UpdateResult
from slime.backends.hf_engine.fields import BadRequest
from slime.backends.hf_engine.http_utils import ENGINE_KEY, body_field, json_body, result_response
from slime.backends.hf_engine.pause import FLUSH_FAILED
from slime.backends.hf_engine.tensor_payload import PayloadError
from slime.backends.hf_engine.weights import WeightUpdateSession

logger = logging.getLogger(__name__)

SESSION_KEY = web.AppKey("weight_update_session", WeightUpdateSession)


def _update_flags(body: dict) -> tuple[str | None, bool, bool]:
    """(weight_version, flush_cache, abort_all_requests) of a weight-update body, type-checked."""
    version = body_field(body, "weight_version", (str, int), None, allow_none=True)
    return (None if version is None else str(version), body_field(body, "flush_cache", bool, True),
            body_field(body, "abort_all_requests", bool, False))


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    path = body_field(body, "model_path", str)
    load_format = body_field(body, "load_format", str, None, allow_none=True)
    if load_format not in (None, "auto"):
        raise BadRequest(f"load_format: only Hugging Face directories ('auto') are loaded, got {load_format!r}")
    version, flush, abort_all = _update_flags(body)
    try:
        res = await engine.update_from_disk(path, version, flush, abort_all)
    except Exception as e:  # noqa: BLE001 - reported to the caller
        logger.exception("update_weights_from_disk failed")
        return result_response(False, f"update_weights_from_disk: {e}", num_paused_requests=0)
    # SGLang's reply field: requests held across the update (ours went on, each token stamped with its version)
    return _update_reply(res, num_paused_requests=res.in_flight)


def _update_reply(res: UpdateResult, **extra) -> web.Response:
    """An update's reply; one whose flush was refused (requests held in place by a pause) failed after loading, with
    SGLang's message (slime/backends/hf_engine/pause.py)."""
    if not res.flushed:
        logger.warning("weights loaded, cache not flushed: %s", res.message)
        return result_response(False, FLUSH_FAILED, **extra)
    return result_response(True, res.message, **extra)


def _selector(body: dict) -> str:
    selector = body_field(body, "selector", str, "all")
    if selector not in WeightUpdateSession.SELECTORS:
        raise BadRequest(f"selector: expected 'target', 'draft' or 'all', got {selector!r}")
    return selector


def _session_refusal(request: web.Request, route: str) -> web.Response | None:
    """SGLang's answer to a tensor / distributed update outside a weight-update session (HTTP 400), or None."""
    why = request.app[SESSION_KEY].refusal(route)
    return None if why is None else result_response(False, why)


def _empty_device_cache(engine: Engine, body: dict, flushed: bool) -> None:
    """`torch_empty_cache`: SGLang empties the device allocator's cache during the flush."""
    if body_field(body, "torch_empty_cache", bool, False) and flushed:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's UpdateWeightsFromTensorReqInput: serialized_named_tensors (one MultiprocessingSerializer payload per
    TP rank), load_format, flush_cache, abort_all_requests, weight_version, selector, torch_empty_cache."""
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    unknown = sorted(set(body) - {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                                  "weight_version", "selector", "torch_empty_cache"})
    if unknown:
        raise BadRequest(f"{unknown[0]}: unknown field (not a field of SGLang's UpdateWeightsFromTensorReqInput)")
    serialized = body_field(body, "serialized_named_tensors", list)
    load_format = body_field(body, "load_format", str, None, allow_none=True)
    version, flush, abort_all = _update_flags(body)
    _selector(body)
    refused = _session_refusal(request, "update_weights_from_tensor")
    if refused is not None:
        return refused
    try:
        res = await engine.update_from_tensor(serialized, load_format, version, flush, abort_all)
    except PayloadError as e:
        raise BadRequest(str(e)) from None
    except Exception as e:  # noqa: BLE001 - reported to the caller
        logger.exception("update_weights_from_tensor failed")
        return result_response(False, f"update_weights_from_tensor: {e}")
    _empty_device_cache(engine, body, flush and res.flushed)
    return _update_reply(res, num_paused_requests=res.in_flight)


async def begin_weight_update(request: web.Request) -> web.Response:
    """SGLang's BeginWeightUpdateReqInput {selector}: open the session the tensor and broadcast updates need."""
    body = await json_body(request, required=False)
    ok, msg = request.app[SESSION_KEY].begin(_selector(body))
    return result_response(ok, msg)


async def end_weight_update(request: web.Request) -> web.Response:
    """SGLang's EndWeightUpdateReqInput {}: close the session."""
    await json_body(request, required=False)
    ok, msg = request.app[SESSION_KEY].end()
    return result_response(ok, msg)


async def init_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    args = (
        body_field(body, "master_address", str), body_field(body, "master_port", int),
        body_field(body, "rank_offset", int), body_field(body, "world_size", int),
        body_field(body, "group_name", str, "weight_update_group"), body_field(body, "backend", str, "gloo"),
    )
    try:
        await asyncio.to_thread(engine.groups.init, *args)
    except Exception as e:  # noqa: BLE001
        logger.exception("init_weights_update_group failed")
        return result_response(False, f"init_weights_update_group: {e}")
    return result_response(True, f"joined weight update group {args[4]!r} as rank {args[2]}")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """SGLang's UpdateWeightsFromDistributedReqInput: names, dtypes, shapes, group_name, flush_cache,
    abort_all_requests, weight_version, load_format, selector, torch_empty_cache. Outside a weight-update session
    it is refused (400) without joining the broadcast, as SGLang does."""
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    names = body_field(body, "names", list)
    dtypes = body_field(body, "dtypes", list)
    shapes = body_field(body, "shapes", list)
    group = body_field(body, "group_name", str, "weight_update_group")
    load_format = body_field(body, "load_format", str, None, allow_none=True)
    if load_format is not None:
        raise BadRequest(f"load_format: {load_format!r} is not supported here (only per-tensor broadcasts, "
                         "load_format null)")
    version, flush, abort_all = _update_flags(body)
    _selector(body)
    refused = _session_refusal(request, "update_weights_from_distributed")
    if refused is not None:
        return refused
    try:
        res = await engine.update_from_distributed(group, names, dtypes, shapes, version, flush, abort_all)
    except Exception as e:  # noqa: BLE001
        logger.exception("update_weights_from_distributed failed")
        return result_response(False, f"update_weights_from_distributed: {e}")
    _empty_device_cache(engine, body, flush and res.flushed)
    return _update_reply(res)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request, required=False)
    name = body_field(body, "group_name", str, "weight_update_group")
    ok = await asyncio.to_thread(engine.groups.destroy, name)
    return result_response(ok, f"destroyed group {name!r}" if ok else f"group_name: no weight update group {name!r}")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request)
    version = body_field(body, "new_version", (str, int))
    if body_field(body, "abort_all_requests", bool, True):
        await engine.call(engine.scheduler.abort, None, "aborted for a weight version update")
    await engine.set_weight_version(str(version))
    return result_response(True, f"Weight version updated to {engine.weight_version}", new_version=engine.weight_version)


def add_weight_routes(app: web.Application) -> None:
    app[SESSION_KEY] = WeightUpdateSession()
    for path, fn in [
        ("/update_weights_from_disk", update_weights_from_disk),
        ("/update_weights_from_tensor", update_weights_from_tensor),
        ("/begin_weight_update", begin_weight_update), ("/end_weight_update", end_weight_update),
        ("/init_weights_update_group", init_weights_update_group),
        ("/update_weights_from_distributed", update_weights_from_distributed),
        ("/destroy_weights_update_group", destroy_weights_update_group),
        ("/update_weight_version", update_weight_version),
    ]:
        app.router.add_post(path, fn)
