"""aiohttp app speaking SGLang's native HTTP API over an `Engine`."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import orjson
from aiohttp import web

from slime.backends.hf_engine.engine import Engine
from slime.backends.hf_engine.protocol import BadRequest, build_response, parse_generate

logger = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", Engine)
SERVER_VERSION = "0.5.23"


def _json(obj, status: int = 200) -> web.Response:
    """A JSON reply serialised with orjson: a /generate reply carries a log-prob per token, and the stdlib
    encoder (~2 us a float) made draining 100 aborted requests cost ~75 ms of engine time."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json({"error": {"message": message, "code": status}}, status=status)


def _result(success: bool, message: str) -> web.Response:
    return _json({"success": success, "message": message}, status=200 if success else 400)


async def _json_body(request: web.Request, required: bool = True) -> dict:
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


def _field(body: dict, name: str, kind, default=..., allow_none=False):
    if name not in body or (body[name] is None and default is not ...):
        if default is ...:
            raise BadRequest(f"{name}: missing")
        return default
    v = body[name]
    if v is None and allow_none:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise BadRequest(f"{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


@web.middleware
async def bad_request_middleware(request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return _error(400, str(e))


class _Run:
    """One /generate request in flight: bridges scheduler events into the event loop."""

    def __init__(self, engine: Engine, inp, stream: bool):
        self.engine, self.inp = engine, inp
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.req = engine.make_request(inp, stream, self._on_event)

    def _on_event(self, snap, finished: bool) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (snap, finished))

    async def start(self) -> None:
        try:
            await self.engine.call(self.engine.scheduler._add, self.req, timeout=60)
        except ValueError as e:
            raise BadRequest(f"rid: {e}") from None

    async def next(self):
        """Latest (snapshot, finished), coalescing queued stream updates."""
        snap, finished = await self.events.get()
        while not finished and not self.events.empty():
            snap, finished = self.events.get_nowait()
        self.done = finished
        return snap, finished

    def response(self, snap, finished: bool) -> dict:
        return build_response(snap, self.engine.tokenizer, self.inp.return_logprob, self.engine.weight_version, finished,
                              self.inp.token_text)

    def cancel_if_running(self) -> None:
        if not self.done:
            self.engine.scheduler.submit(self.engine.scheduler.abort, self.req.rid, "client disconnected")


async def _run_to_end(engine: Engine, inp) -> dict:
    run = _Run(engine, inp, stream=False)
    try:
        await run.start()
        while True:
            snap, finished = await run.next()
            if finished:
                return run.response(snap, True)
    finally:
        run.cancel_if_running()


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    inputs, is_batch = parse_generate(body, engine.tokenizer, engine.vocab_size, engine.max_positions)
    if is_batch:
        return _json(list(await asyncio.gather(*(_run_to_end(engine, i) for i in inputs))))
    inp = inputs[0]
    if not inp.stream:
        return _json(await _run_to_end(engine, inp))
    run = _Run(engine, inp, stream=True)
    await run.start()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        while True:
            snap, finished = await run.next()
            await resp.write(b"data: " + orjson.dumps(run.response(snap, finished)) + b"\n\n")
            if finished:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        logger.info("stream client for rid %s went away", inp.rid)
    finally:
        run.cancel_if_running()
    return resp


async def abort_request(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request, required=False)
    if body.get("abort_all"):
        await engine.call(engine.scheduler.abort, None, "aborted by /abort_request (abort_all)")
    elif body.get("rid") is not None:
        rids = body["rid"] if isinstance(body["rid"], list) else [body["rid"]]
        for rid in rids:
            await engine.call(engine.scheduler.abort, str(rid), "aborted by /abort_request")
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    path = _field(body, "model_path", str)
    version = _field(body, "weight_version", (str, int), None, allow_none=True)
    try:
        msg = await engine.update_from_disk(
            path, None if version is None else str(version), bool(body.get("flush_cache", True)),
            bool(body.get("abort_all_requests", False)),
        )
    except Exception as e:  # noqa: BLE001 - reported to the caller
        logger.exception("update_weights_from_disk failed")
        return _result(False, f"update_weights_from_disk: {e}")
    return _result(True, msg)


async def init_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    args = (
        _field(body, "master_address", str), _field(body, "master_port", int), _field(body, "rank_offset", int),
        _field(body, "world_size", int), _field(body, "group_name", str, "weight_update_group"),
        _field(body, "backend", str, "gloo"),
    )
    try:
        await asyncio.to_thread(engine.groups.init, *args)
    except Exception as e:  # noqa: BLE001
        logger.exception("init_weights_update_group failed")
        return _result(False, f"init_weights_update_group: {e}")
    return _result(True, f"joined weight update group {args[4]!r} as rank {args[2]}")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    names = _field(body, "names", list)
    dtypes = _field(body, "dtypes", list)
    shapes = _field(body, "shapes", list)
    group = _field(body, "group_name", str, "weight_update_group")
    version = _field(body, "weight_version", (str, int), None, allow_none=True)
    try:
        msg = await engine.update_from_distributed(
            group, names, dtypes, shapes, None if version is None else str(version),
            bool(body.get("flush_cache", True)), bool(body.get("abort_all_requests", False)),
        )
    except Exception as e:  # noqa: BLE001
        logger.exception("update_weights_from_distributed failed")
        return _result(False, f"update_weights_from_distributed: {e}")
    return _result(True, msg)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request, required=False)
    name = _field(body, "group_name", str, "weight_update_group")
    ok = await asyncio.to_thread(engine.groups.destroy, name)
    return _result(ok, f"destroyed group {name!r}" if ok else f"group_name: no weight update group {name!r}")


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request)
    version = _field(body, "new_version", (str, int))
    if body.get("abort_all_requests", True):
        await engine.call(engine.scheduler.abort, None, "aborted for a weight version update")
    engine.weight_version = str(version)
    return _result(True, f"weight_version={engine.weight_version}")


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _json_body(request, required=False)
    mode = body.get("mode", "abort")
    sched = engine.scheduler

    def pause():
        sched.set_paused(True)
        if mode == "abort":
            return sched.abort(None, "aborted by /pause_generation")
        if mode == "retract":
            return sched.retract()
        return 0

    if mode not in ("abort", "retract", "in_place"):
        raise BadRequest(f"mode: expected abort, retract or in_place, got {mode!r}")
    n = await engine.call(pause)
    return _result(True, f"paused ({mode}); {n} requests affected")


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    await engine.call(engine.scheduler.set_paused, False)
    return _result(True, "generation continues")


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler
    busy = await engine.call(lambda: sched.num_running + sched.num_waiting)
    if busy:
        return web.Response(status=400, text=f"Cache not flushed: {busy} requests are running or waiting.")
    await engine.call(sched.prefix_cache.clear)
    return web.Response(status=200, text="Cache flushed.")


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    alive = engine.scheduler._thread.is_alive()
    return web.Response(status=200 if alive else 503)


async def health_generate(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.scheduler._thread.is_alive():
        return web.Response(status=503)
    if engine.scheduler.paused:
        return web.Response(status=200)
    from slime.backends.hf_engine.protocol import GenerateInput
    from slime.backends.hf_engine.sampling import SamplingParams

    bos = engine.tokenizer.bos_token_id or 0
    inp = GenerateInput(f"HEALTH_CHECK_{time.time_ns()}", [bos], SamplingParams(max_new_tokens=1, temperature=0.0), False, False)
    try:
        await asyncio.wait_for(_run_to_end(engine, inp), 20)
    except asyncio.TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


def _model_info(engine: Engine) -> dict:
    cfg = engine.model.config
    return {
        "model_path": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    }


async def get_model_info(request: web.Request) -> web.Response:
    return _json(_model_info(request.app[ENGINE_KEY]))


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = engine.cfg
    info = {
        **_model_info(engine),
        "host": request.app["host"],
        "port": request.app["port"],
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "max_running_requests": cfg.max_running_requests,
        "max_total_num_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": cfg.max_prefill_tokens,
        "context_length": engine.max_positions,
        "dtype": cfg.dtype,
        "random_seed": cfg.seed,
        "disaggregation_mode": "null",
        "version": SERVER_VERSION,
        "backend": "slime.hf_engine",
        "internal_states": [{"weight_version": engine.weight_version, "paused": engine.scheduler.paused,
                             "scheduler_stats": engine.scheduler.stats.as_dict(),
                             "prefix_cache_entries": len(engine.scheduler.prefix_cache)}],
    }
    return _json(info)


async def get_load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler
    used = sched.token_usage()
    return _json([{
        "dp_rank": 0,
        "num_reqs": sched.num_running,
        "num_waiting_reqs": sched.num_waiting,
        "num_tokens": used,
        "num_pending_tokens": 0,
        "token_usage": used / max(1, engine.cfg.max_total_tokens),
        "ts_tic": time.time(),
    }])


async def v1_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return _json({"object": "list", "data": [{
        "id": engine.model_path, "object": "model", "created": int(request.app["started"]), "owned_by": "sglang",
        "root": engine.model_path, "max_model_len": engine.max_positions,
    }]})


def build_app(engine: Engine, host: str, port: int) -> web.Application:
    app = web.Application(middlewares=[bad_request_middleware], client_max_size=1 << 30)
    app[ENGINE_KEY] = engine
    app["host"], app["port"], app["started"] = host, port, time.time()
    post = [
        ("/generate", generate), ("/abort_request", abort_request),
        ("/update_weights_from_disk", update_weights_from_disk),
        ("/init_weights_update_group", init_weights_update_group),
        ("/update_weights_from_distributed", update_weights_from_distributed),
        ("/destroy_weights_update_group", destroy_weights_update_group),
        ("/update_weight_version", update_weight_version),
        ("/pause_generation", pause_generation), ("/continue_generation", continue_generation),
    ]
    for path, fn in post:
        app.router.add_post(path, fn)
    for path, fn in [("/health", health), ("/health_generate", health_generate), ("/get_model_info", get_model_info),
                     ("/get_server_info", get_server_info), ("/get_load", get_load), ("/v1/models", v1_models),
                     ("/flush_cache", flush_cache)]:
        app.router.add_get(path, fn)
    app.router.add_post("/flush_cache", flush_cache)
    return app


async def serve(engine: Engine, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT; then abort everything, release groups, stop the scheduler."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine.start()
    runner = web.AppRunner(build_app(engine, host, port), handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logger.info("hf_engine serving %s on http://%s:%d", engine.model_path, host, port)
    try:
        await stop.wait()
    finally:
        logger.info("hf_engine shutting down")
        await asyncio.to_thread(engine.scheduler.stop)
        logger.debug("scheduler stopped")
        await runner.cleanup()
        logger.debug("http runner cleaned up")
        engine.groups.destroy_all()
