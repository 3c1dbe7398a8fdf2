"""Read-only endpoints of the embedded engine: health, model/server info, loads, weight version.

Shapes follow SGLang: `/get_load` (a list per DP rank), `/v1/loads?include=...` (the newer load API that
upstream slime's abort-until-idle loop polls), `/get_weight_version`, `/get_model_info` and its newer
alias `/model_info`, `/get_server_info`, `/v1/models`.
"""

from __future__ import annotations

import datetime
import time

import torch

from aiohttp import web

from slime.backends.hf_engine.engine import Engine
from slime.backends.hf_engine.fields import BadRequest
from slime.backends.hf_engine.http_utils import ENGINE_KEY, SERVER_VERSION, json_response

# SGLang's /v1/loads sections; "core" is always filled, "queues" is ours to fill, the rest do not apply here
# (no speculative decoding, no LoRA, no disaggregation, no memory breakdown on CPU): like SGLang, a section
# that does not apply is left out.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(status=200 if engine.scheduler._thread.is_alive() else 503)


def model_info(engine: Engine) -> dict:
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
    return json_response(model_info(request.app[ENGINE_KEY]))


async def get_weight_version(request: web.Request) -> web.Response:
    return json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def get_server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = engine.cfg
    info = {
        **model_info(engine),
        "host": request.app["host"],
        "port": request.app["port"],
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "max_running_requests": cfg.max_running_requests,
        "max_total_num_tokens": cfg.max_total_tokens,
        "chunked_prefill_size": cfg.chunked_prefill_size,
        "max_prefill_tokens": cfg.max_prefill_tokens,
        "page_size": cfg.block_size,
        "bucket_min_saving": engine.scheduler.batch.min_bucket_saving,
        "context_length": engine.max_positions,
        "dtype": engine.dtype,
        "device": engine.device.type,
        "device_name": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
        "random_seed": cfg.seed,
        "enable_memory_saver": cfg.memory_saver,
        "enable_weights_cpu_backup": cfg.weights_cpu_backup,
        "disaggregation_mode": "null",
        "version": SERVER_VERSION,
        "backend": "slime.hf_engine",
        "internal_states": [{"weight_version": engine.weight_version, "paused": engine.scheduler.paused,
                             "scheduler_stats": {**engine.scheduler.stats.as_dict(), **engine.scheduler.cpu_times()},
                             "prefix_cache_entries": len(engine.scheduler.prefix_cache),
                             "memory": await engine.call(engine.memory.state, timeout=30)}],
    }
    return json_response(info)


async def get_load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler
    used = sched.token_usage()
    return json_response([{
        "dp_rank": 0,
        "num_reqs": sched.num_running,
        "num_waiting_reqs": sched.num_waiting,
        "num_tokens": used,
        "num_pending_tokens": 0,
        "token_usage": used / max(1, engine.cfg.max_total_tokens),
        "ts_tic": time.time(),
    }])


def _load_snapshot(engine: Engine, include: set[str]) -> dict:
    sched = engine.scheduler
    running, waiting = sched.num_running, sched.num_waiting
    used = sched.token_usage()
    pending = sum(r.num_tokens for r in list(sched.waiting))
    cap = max(1, engine.cfg.max_total_tokens)
    stats = sched.stats
    load = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": used,
        "num_total_tokens": used + pending,
        "max_total_num_tokens": engine.cfg.max_total_tokens,
        "token_usage": round(used / cap, 4),
        "gen_throughput": 0.0,  # not measured per interval
        "cache_hit_rate": round(stats.cache_hit_tokens / max(1, stats.prefill_tokens + stats.cache_hit_tokens), 4),
        "utilization": round(running / max(1, engine.cfg.max_running_requests), 4),
        "max_running_requests": engine.cfg.max_running_requests,
        "num_total_reqs": running + waiting,
    }
    if include & {"queues", "all"}:
        load["queues"] = {"waiting": waiting, "grammar": 0, "paused": running + waiting if sched.paused else 0,
                          "retracted": 0}
    return load


async def v1_loads(request: web.Request) -> web.Response:
    """SGLang's GET /v1/loads?include=core,queues&dp_rank=0 (format=json only)."""
    engine = request.app[ENGINE_KEY]
    q = request.query
    include = {s.strip() for s in q.get("include", "all").split(",") if s.strip()} or {"all"}
    bad = include - set(LOAD_SECTIONS)
    if bad:
        raise BadRequest(f"include: unknown section(s) {sorted(bad)}; valid: {', '.join(LOAD_SECTIONS)}")
    if q.get("format", "json") != "json":
        raise BadRequest(f"format: only 'json' is served, got {q['format']!r}")
    dp_rank = q.get("dp_rank")
    if dp_rank is not None and not dp_rank.lstrip("-").isdigit():
        raise BadRequest(f"dp_rank: expected an integer, got {dp_rank!r}")
    loads = [] if dp_rank not in (None, "0") else [_load_snapshot(engine, include)]
    n = max(1, len(loads))
    return json_response({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": SERVER_VERSION,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": {
            "total_running_reqs": sum(ld["num_running_reqs"] for ld in loads),
            "total_waiting_reqs": sum(ld["num_waiting_reqs"] for ld in loads),
            "total_reqs": sum(ld["num_total_reqs"] for ld in loads),
            "total_used_tokens": sum(ld["num_used_tokens"] for ld in loads),
            "total_tokens": sum(ld["num_total_tokens"] for ld in loads),
            "avg_token_usage": round(sum(ld["token_usage"] for ld in loads) / n, 4),
            "avg_throughput": 0.0,
            "avg_utilization": round(sum(ld["utilization"] for ld in loads) / n, 4),
        },
    })


async def v1_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return json_response({"object": "list", "data": [{
        "id": engine.model_path, "object": "model", "created": int(request.app["started"]), "owned_by": "sglang",
        "root": engine.model_path, "max_model_len": engine.max_positions,
    }]})


def add_info_routes(app: web.Application) -> None:
    for path, fn in [("/health", health), ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                     ("/get_server_info", get_server_info), ("/get_load", get_load), ("/v1/loads", v1_loads),
                     ("/get_weight_version", get_weight_version), ("/v1/models", v1_models)]:
        app.router.add_get(path, fn)
