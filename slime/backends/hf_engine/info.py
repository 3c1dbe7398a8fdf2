"""Read-only endpoints of the embedded engine, shaped as SGLang 0.5.23's: `/health`, `/v1/loads`, `/model_info`,
`/server_info` (and their `/get_*` aliases), `/v1/models`; `/get_load` and `/get_weight_version`, removed in 0.5.21,
answer 404.
"""

from __future__ import annotations

import datetime
import time

import torch

from aiohttp import web

from slime.backends.hf_engine.engine import Engine
from slime.backends.hf_engine.http_utils import ENGINE_KEY, SERVER_VERSION, json_response

# SGLang's /v1/loads sections; "core" is always filled, "queues" is ours to fill; as in SGLang, a section that
# does not apply (speculative decoding, LoRA, disaggregation, memory breakdown) is left out.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.Response(status=200 if engine.scheduler._thread.is_alive() else 503)


def model_info(engine: Engine) -> dict:
    cfg = engine.model.config
    return {
        "model_path": engine.model_path,
        "served_model_name": engine.model_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "load_format": "auto",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": getattr(cfg, "architectures", None),
    }


async def get_model_info(request: web.Request) -> web.Response:
    return json_response(model_info(request.app[ENGINE_KEY]))


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
        "disable_cuda_graph": not engine.scheduler.batch.graphs.enabled,
        "cuda_graph_max_bs": cfg.cuda_graph_max_bs,
        "cuda_graph_mode": engine.scheduler.batch.graphs.describe(),
        "enable_mixed_chunk": engine.scheduler.step_composition == "mixed",  # SGLang's: one forward per step
        "enable_weights_cpu_backup": cfg.weights_cpu_backup,
        "disaggregation_mode": "null",
        "version": SERVER_VERSION,  # SGLang reports sglang.__version__: we report the version whose API we serve
        "frontend": "python",
        "backend": "slime.hf_engine",
        "startup_time": request.app["started"],
        "internal_states": [{"weight_version": engine.weight_version, "paused": engine.scheduler.paused,
                             "scheduler_stats": {**engine.scheduler.stats.as_dict(), **engine.scheduler.cpu_times(),
                                                 **engine.scheduler.batch.graphs.counters()},
                             "prefix_cache_entries": len(engine.scheduler.prefix_cache),
                             "memory": await engine.call(engine.memory.state, timeout=30)}],
    }
    return json_response(info)


def _load_snapshot(engine: Engine, include: set[str]) -> dict:
    """One DP rank's load, as SGLang's LoadSnapshot.to_dict(include): its core fields, then the sections asked."""
    sched = engine.scheduler
    running, waiting = sched.num_running, sched.num_waiting
    used = sched.token_usage()
    pending = sum(r.num_tokens for r in list(sched.waiting))
    cap = max(1, engine.cfg.max_total_tokens)
    stats = sched.stats
    load = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_waiting_uncached_tokens": pending,
        "num_used_tokens": used,
        "num_total_tokens": used + pending,
        "num_active_tokens": used + pending,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": engine.cfg.max_total_tokens,
        "max_running_requests": engine.cfg.max_running_requests,
        "token_usage": round(used / cap, 4),
        "gen_throughput": 0.0,  # not measured per interval
        "cache_hit_rate": round(stats.cache_hit_tokens / max(1, stats.prefill_tokens + stats.cache_hit_tokens), 4),
        "utilization": round(running / max(1, engine.cfg.max_running_requests), 4),
        "total_prefill_uncached_tokens": stats.prefill_tokens,
        "total_prefill_busy_us": int(1e6 * stats.prefill_s),
        "decode_moments": None,
    }
    if include & {"queues", "all"}:
        load["queues"] = {"waiting": waiting, "grammar": 0, "paused": running + waiting if sched.paused else 0,
                          "retracted": 0, "prealloc_ready": 0}
    return load


async def v1_loads(request: web.Request) -> web.Response:
    """SGLang's GET /v1/loads?include=core,queues&dp_rank=0 (format=json only). A bad section or dp_rank is a 400
    with FastAPI's `{"detail"}`, as SGLang answers."""
    engine = request.app[ENGINE_KEY]
    q = request.query
    include = {s.strip() for s in q["include"].split(",")} if q.get("include") else {"all"}
    bad = include - set(LOAD_SECTIONS)
    if bad:
        return json_response({"detail": f"Invalid include sections: {sorted(bad)}. Valid options: "
                                        f"{sorted(LOAD_SECTIONS)}"}, status=400)
    if q.get("format", "json") != "json":
        return json_response({"detail": f"format: only 'json' is served here, got {q['format']!r}"}, status=400)
    dp_rank = q.get("dp_rank")
    if dp_rank is not None and not dp_rank.lstrip("-").isdigit():
        return json_response({"detail": f"dp_rank: expected an integer, got {dp_rank!r}"}, status=422)
    loads = [] if dp_rank not in (None, "0") else [_load_snapshot(engine, include)]
    return json_response({
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": SERVER_VERSION,
        "accelerator": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
        "num_accelerators": 1,
        "loads": loads,
    })


async def v1_models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return json_response({"object": "list", "data": [{
        "id": engine.model_path, "object": "model", "created": int(request.app["started"]), "owned_by": "sglang",
        "root": engine.model_path, "max_model_len": engine.max_positions,
    }]})


def add_info_routes(app: web.Application) -> None:
    for path, fn in [("/health", health), ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                     ("/get_server_info", get_server_info), ("/server_info", get_server_info),
                     ("/v1/loads", v1_loads), ("/v1/models", v1_models)]:
        app.router.add_get(path, fn)
