"""aiohttp app speaking SGLang's native HTTP API over an `Engine`: generation and control routes (read-only routes in
`info.py`, weight updates in `weight_routes.py`), following SGLang at the version we pin
(`slime/utils/sglang_versions.py`; deliberate differences in docs/sglang-compat.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import orjson
from aiohttp import web

from slime.backends.hf_engine import pause
from slime.backends.hf_engine.engine import Engine, EngineUnavailable
from slime.backends.hf_engine.fields import BadRequest
from slime.backends.hf_engine.http_utils import (
    ENGINE_KEY, bad_request_middleware, body_field, error_response, json_body, json_response, result_response,
)
from slime.backends.hf_engine.memory import MemoryStateError, parse_tags
from slime.backends.hf_engine.pause import HoldNewRequests
from slime.backends.hf_engine.info import add_info_routes
from slime.backends.hf_engine.weight_routes import add_weight_routes
from slime.backends.hf_engine.protocol import GenerateInput, build_response, parse_generate
from slime.backends.hf_engine.sampling import SamplingParams
from slime.utils.gc_utils import freeze_gc_heap

logger = logging.getLogger(__name__)



HOLD_KEY = web.AppKey("hold_new_requests", HoldNewRequests)


class _Run:
    """One /generate request in flight: bridges scheduler events into the event loop."""

    def __init__(self, engine: Engine, inp, stream: bool, hold: HoldNewRequests):
        self.engine, self.inp, self.hold = engine, inp, hold
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.req = engine.make_request(inp, stream, self._on_event)

    def _on_event(self, snap, finished: bool) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (snap, finished))

    async def start(self) -> None:
        await self.hold.wait()  # paused: held before the scheduler sees it, as SGLang's tokenizer manager holds it
        try:
            await self.engine.call(self.engine.admit, self.req, timeout=60)
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


async def _run_to_end(engine: Engine, inp, hold: HoldNewRequests) -> dict:
    run = _Run(engine, inp, False, hold)
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
    try:
        return await _generate(request, engine)
    except EngineUnavailable as e:  # memory released: a deliberate state, not a client error
        return error_response(503, str(e))


async def _generate(request: web.Request, engine: Engine) -> web.StreamResponse:
    body = await json_body(request)
    inputs, is_batch = parse_generate(body, engine.tokenizer, engine.vocab_size, engine.max_positions)
    hold = request.app[HOLD_KEY]
    if is_batch:
        return json_response(list(await asyncio.gather(*(_run_to_end(engine, i, hold) for i in inputs))))
    inp = inputs[0]
    if not inp.stream:
        return json_response(await _run_to_end(engine, inp, hold))
    run = _Run(engine, inp, True, hold)
    await run.start()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    interval = inp.params.stream_interval or 1
    sent = 0  # tokens in the last chunk written
    try:
        await resp.prepare(request)
        while True:
            snap, finished = await run.next()
            if finished or len(snap.output_ids) - sent >= interval:  # sampling_params.stream_interval
                await resp.write(b"data: " + orjson.dumps(run.response(snap, finished)) + b"\n\n")
                sent = len(snap.output_ids)
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
    body = await json_body(request, required=False)
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise BadRequest(f"rid: expected a string or a list of strings, got {rid!r}")
    if body_field(body, "abort_all", bool, False):
        await engine.call(engine.scheduler.abort, None)
    elif rid is not None:
        for r in [rid] if isinstance(rid, str) else rid:
            await engine.call(engine.scheduler.abort, r)
    return web.Response(status=200)


async def _memory_call(request: web.Request, release: bool) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await json_body(request, required=False)
    extra = sorted(set(body) - {"tags"})
    if extra:
        raise BadRequest(f"{extra[0]}: unknown field (SGLang's memory occupation requests have only tags)")
    try:
        tags = parse_tags(body.get("tags"))
    except ValueError as e:
        raise BadRequest(str(e)) from None
    try:
        msg = await (engine.release_memory(tags) if release else engine.resume_memory(tags))
    except MemoryStateError as e:
        return result_response(False, str(e))
    logger.info("%s", msg)
    return result_response(True, msg)


async def release_memory_occupation(request: web.Request) -> web.Response:
    return await _memory_call(request, release=True)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    return await _memory_call(request, release=False)


async def pause_generation(request: web.Request) -> web.Response:
    """SGLang's /pause_generation {mode}: new requests are held from now on; abort aborts every request, retract and
    in_place stop the scheduler (slime/backends/hf_engine/pause.py)."""
    engine = request.app[ENGINE_KEY]
    body = await json_body(request, required=False)
    mode = body_field(body, "mode", str, "abort")
    if mode not in pause.MODES:
        raise BadRequest(f"mode: expected abort, retract or in_place, got {mode!r}")
    request.app[HOLD_KEY].close()  # before the scheduler's part: nothing new reaches it after this point
    n = await engine.call(pause.pause, engine.scheduler, mode)
    logger.info("paused (%s); %d requests %s", mode, n, "aborted" if mode == "abort" else "held")
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    await json_body(request, required=False)
    await engine.call(pause.resume, engine.scheduler)
    request.app[HOLD_KEY].open()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache[?timeout=S]: flush when no request runs or waits; with a timeout, wait for that up to
    S seconds. Plain-text replies: 200 when flushed, 400 when not."""
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler
    raw = request.query.get("timeout", "0")
    try:
        timeout = float(raw)
    except ValueError:
        raise BadRequest(f"timeout: expected a number of seconds, got {raw!r}") from None
    if not timeout >= 0:
        raise BadRequest(f"timeout: must be >= 0, got {raw!r}")

    def flush_if_idle() -> int:  # SGLang: while paused, the requests waiting do not stop a flush (pause.py)
        return 0 if pause.flush_if_idle(sched) else sched.num_running + sched.num_waiting

    deadline = time.monotonic() + timeout
    while True:
        busy = await engine.call(flush_if_idle)
        if not busy:
            return web.Response(status=200, text=FLUSHED)
        if time.monotonic() >= deadline:
            why = "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed."
            return web.Response(status=400, text=f"{why} {busy} requests are running or waiting.\n")
        await asyncio.sleep(0.01)


async def freeze_gc(request: web.Request) -> web.Response:
    """SGLang's `/freeze_gc`: move what the process holds now out of the garbage collector's scans (the server
    already did so once after loading the model; a warmed-up server can do it again)."""
    await asyncio.to_thread(freeze_gc_heap, "hf_engine (/freeze_gc)")
    return web.Response(status=200, text="Garbage collection frozen.\n")


def _steps(engine: Engine) -> int:
    st = engine.scheduler.stats
    return st.decode_steps + st.prefills


async def health_generate(request: web.Request) -> web.Response:
    """SGLang 0.5.23's rule (python/sglang/srt/entrypoints/http_server.py, `health_generate`): a one-token request
    is sent, and the engine is healthy as soon as it makes progress (a step ends, this request's or any other's)
    within SGLANG_HEALTH_CHECK_TIMEOUT seconds (default 20), so a busy engine passes without waiting its turn."""
    engine = request.app[ENGINE_KEY]
    if not engine.scheduler._thread.is_alive():
        return web.Response(status=503)
    hold = request.app[HOLD_KEY]
    if engine.scheduler.paused or hold.holding or engine.memory.generation_blocker() is not None:
        return web.Response(status=200)  # alive, deliberately not generating (paused, or memory released)
    bos = engine.tokenizer.bos_token_id or 0
    inp = GenerateInput(f"HEALTH_CHECK_{time.time_ns()}", [bos], SamplingParams(max_new_tokens=1, temperature=0.0), False, False)
    steps = _steps(engine)
    own = asyncio.ensure_future(_run_to_end(engine, inp, hold))
    deadline = time.monotonic() + float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
    try:
        while time.monotonic() < deadline:
            await asyncio.wait([own], timeout=0.1)
            if own.done():
                return web.Response(status=200 if own.exception() is None else 503)
            if _steps(engine) > steps:
                return web.Response(status=200)
        return web.Response(status=503)
    finally:
        own.cancel()


def build_app(engine: Engine, host: str, port: int) -> web.Application:
    app = web.Application(middlewares=[bad_request_middleware], client_max_size=1 << 30)
    app[ENGINE_KEY] = engine
    app[HOLD_KEY] = HoldNewRequests()
    app["host"], app["port"], app["started"] = host, port, time.time()
    post = [
        ("/generate", generate), ("/abort_request", abort_request),
        ("/release_memory_occupation", release_memory_occupation),
        ("/resume_memory_occupation", resume_memory_occupation),
        ("/pause_generation", pause_generation), ("/continue_generation", continue_generation),
        ("/flush_cache", flush_cache), ("/freeze_gc", freeze_gc),
    ]
    for path, fn in post:
        app.router.add_post(path, fn)
    app.router.add_put("/generate", generate)  # SGLang serves POST and PUT
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_get("/freeze_gc", freeze_gc)
    app.router.add_get("/health_generate", health_generate)
    add_info_routes(app)
    add_weight_routes(app)
    return app


async def serve(engine: Engine, host: str, port: int) -> None:
    """Serve until SIGTERM/SIGINT; then abort everything, release groups, stop the scheduler."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # the model, torch and transformers are loaded: keep their objects out of every later full collection, which
    # would otherwise stall the scheduler thread (it shares the GIL) for a walk over all of them
    freeze_gc_heap("hf_engine")
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
