"""SGLang's own HTTP server code on CPU, for the contract tests (`test_sglang_contract.py`).

    python tests/sglang_real_server.py --site DIR [--site DIR ...] --port P

`--site`: folders holding the `sglang` package (one version) and the few pure-Python packages its modules import
(`tools/sglang_contract_env.py` installs them). What runs is SGLang's own code, at the version found there:

- its FastAPI app (`sglang.srt.entrypoints.http_server.app`): routes, request bodies parsed into its request types;
- its tokenizer-side control code (`TokenizerControlMixin`: pause/lock handling, payload normalizers, fan-out
  communicators, `get_loads`; `TokenizerManager.pause_generation` / `continue_generation`);
- its scheduler-side weight-update code (`SchedulerWeightUpdaterManager`: the weight-update session, flush after
  an update) and flush wrapper (`SchedulerFlushWrapper`);
- its tensor-parallel worker and model-runner weight-update code (`TpModelWorker` / `ModelRunner` or, newer,
  the runner's `WeightUpdater`): `init_custom_process_group`, the broadcast receive, `MultiprocessingSerializer`
  with its unpickler, `FlattenedTensorBucket`.

Stood in: zmq between the tokenizer and scheduler processes (a thread here), the scheduler's request queue (a
count of requests that an abort clears), the runtime configuration SGLang publishes at launch (tp rank 0, one
DP rank, no weight cache), and the model: `StandInModel.load_weights` keeps what it is given (both stand-ins in
sglang_stand_ins.py). Extra routes under
`/_contract/` let a test read what was loaded and set how many requests are running.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import threading
import types

logger = logging.getLogger("sglang_real_server")


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--site", action="append", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--abort-rounds", type=int, default=1,
                   help="abort_all requests it takes to clear the running requests (a queue refilling meanwhile)")
    return p.parse_args()


def build(site_dirs: list[str], abort_rounds: int):
    for d in reversed(site_dirs):
        sys.path.insert(0, d)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sglang_stand_ins
    from sglang_stand_ins import StandInModel, StandInScheduler

    sglang_stand_ins.install()
    import torch
    import torch.distributed as dist

    # SGLang asserts a default process group before it joins a weight-update group (its TP group)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    import sglang
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.managers import io_struct
    from sglang.srt.managers import tokenizer_control_mixin as tcm
    from sglang.srt.managers import tokenizer_manager as tm_mod
    from sglang.srt.managers import tp_worker as tpw
    from sglang.srt.managers.scheduler_components import weight_updater as swu
    from sglang.srt.managers.scheduler_components.flush_wrapper import SchedulerFlushWrapper
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from sglang.utils import TypeBasedDispatcher

    version = sglang.__version__
    model = StandInModel()
    sched = StandInScheduler(abort_rounds)
    cpu_group = dist.new_group([0], backend="gloo")

    # the runtime configuration SGLang publishes at launch: one TP rank, one DP rank, no weight cache
    parallel = types.SimpleNamespace(tp_rank=0, tp_size=1, dp_size=1, num_dp_ranks=1, pp_size=1, attn_dp_enabled=False,
                                     enable_dp_attention_local_control_broadcast=False,
                                     tp_group=types.SimpleNamespace(cpu_group=cpu_group))
    model_cfg = types.SimpleNamespace(weight_cache_mode="off")
    for mod_name in ("sglang.srt.managers.tokenizer_control_mixin",
                     "sglang.srt.managers.scheduler_components.weight_updater",
                     "sglang.srt.managers.tp_worker",
                     "sglang.srt.model_executor.model_runner_components.weight_updater",
                     "sglang.srt.entrypoints.v1_loads"):
        mod = sys.modules.get(mod_name)
        if mod is None:
            try:
                __import__(mod_name)
                mod = sys.modules[mod_name]
            except ImportError:
                continue
        if hasattr(mod, "get_parallel"):
            mod.get_parallel = lambda: parallel
        if hasattr(mod, "get_model"):
            mod.get_model = lambda: model_cfg

    # ---- the model runner's weight-update code (SGLang's), over the stand-in model -------------------
    runner_wu_mod = sys.modules.get("sglang.srt.model_executor.model_runner_components.weight_updater")
    if runner_wu_mod is not None and hasattr(runner_wu_mod, "WeightUpdater"):  # 0.5.2x: a component
        disk_loads = []

        def update_model_fields(*a, **k):
            pass

        runner_wu = runner_wu_mod.WeightUpdater(
            tp_rank=0, device="cpu", gpu_id=0, model_config=types.SimpleNamespace(), custom_weight_loaders={},
            get_model=lambda: model, update_model_fields=update_model_fields, recapture_cuda_graph=lambda: None,
            get_model_runner=lambda: None)
        runner_wu_obj = runner_wu

        class RunnerWeightUpdater:
            """SGLang's runner WeightUpdater; disk loading (SGLang's model loader) is the model's stand-in."""

            def __getattr__(self, name):
                return getattr(runner_wu_obj, name)

            def update_weights_from_disk(self, model_path, load_format, **kwargs):
                disk_loads.append(model_path)
                return True, "Succeeded to update model weights."

        runner = types.SimpleNamespace(weight_updater=RunnerWeightUpdater(), model=model)
        worker = types.SimpleNamespace(model_runner=runner, _model_runner=runner, tp_rank=0)
        for name in ("init_weights_update_group", "destroy_weights_update_group", "deserialize_own_rank",
                     "weight_update_runners"):
            setattr(worker, name, types.MethodType(getattr(tpw.TpModelWorker, name), worker))
    else:  # 0.5.15: the methods live on ModelRunner
        from sglang.srt.model_executor import model_runner as mr

        disk_loads = []
        runner = types.SimpleNamespace(model=model, tp_rank=0, tp_size=1, device="cpu", _model_update_group={},
                                       server_args=types.SimpleNamespace(custom_weight_loader=[]))
        for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                     "_update_bucketed_weights_from_distributed", "update_weights_from_tensor",
                     "_update_weights_from_flattened_bucket"):
            setattr(runner, name, types.MethodType(getattr(mr.ModelRunner, name), runner))

        def runner_disk(model_path, load_format, **kwargs):
            disk_loads.append(model_path)
            return True, "Succeeded to update model weights."

        runner.update_weights_from_disk = runner_disk
        worker = types.SimpleNamespace(model_runner=runner, tp_rank=0)
        for name in ("init_weights_update_group", "destroy_weights_update_group", "update_weights_from_distributed",
                     "update_weights_from_tensor", "update_weights_from_disk"):
            setattr(worker, name, types.MethodType(getattr(tpw.TpModelWorker, name), worker))

    # ---- the scheduler's weight-update manager and flush wrapper (SGLang's) ---------------------------
    init_fields = {f.name for f in dataclasses.fields(swu.SchedulerWeightUpdaterManager) if f.init}
    kw = dict(tp_worker=worker, draft_worker=None, memory_saver_adapter=None, flush_cache=sched.flush_cache,
              is_fully_idle=sched.is_fully_idle, scheduler=sched)
    if "tp_cpu_group" in init_fields:  # 0.5.15 takes it; 0.5.2x reads it from the parallel state
        kw["tp_cpu_group"] = cpu_group
    manager = swu.SchedulerWeightUpdaterManager(**kw)
    replies: list = []

    def send_output(out, req=None):  # a deferred flush's reply
        replies.append(out)

    import inspect

    if "send_output" in inspect.signature(SchedulerFlushWrapper.__init__).parameters:
        reply_kw = {"send_output": send_output}
    else:  # 0.5.15: through the scheduler's IPC channels
        reply_kw = {"ipc_channels": types.SimpleNamespace(send_to_tokenizer=types.SimpleNamespace(
            send_output=send_output))}
    flush_wrapper = SchedulerFlushWrapper(flush_cache=sched.flush_cache, is_fully_idle=sched.is_fully_idle, **reply_kw)

    def pause(req):
        sched.paused = True

    def resume(req):
        sched.paused = False

    handlers = [
        (io_struct.FlushCacheReqInput, flush_wrapper.handle),
        (io_struct.AbortReq, sched.abort),
        (io_struct.UpdateWeightFromDiskReqInput, manager.update_weights_from_disk),
        (io_struct.InitWeightsUpdateGroupReqInput, manager.init_weights_update_group),
        (io_struct.DestroyWeightsUpdateGroupReqInput, manager.destroy_weights_update_group),
        (io_struct.UpdateWeightsFromDistributedReqInput, manager.update_weights_from_distributed),
        (io_struct.UpdateWeightsFromTensorReqInput, manager.update_weights_from_tensor),
        (io_struct.PauseGenerationReqInput, pause),
        (io_struct.ContinueGenerationReqInput, resume),
    ]
    for req_name, fn_name in (("BeginWeightUpdateReqInput", "begin_weight_update"),
                              ("EndWeightUpdateReqInput", "end_weight_update")):
        if hasattr(io_struct, req_name):
            handlers.append((getattr(io_struct, req_name), getattr(manager, fn_name)))
    sched_dispatch = TypeBasedDispatcher(handlers)

    # ---- the tokenizer manager: SGLang's control mixin, zmq replaced by a thread ----------------------
    class ControlPlane(tcm.TokenizerControlMixin):
        pass

    tm = ControlPlane()
    tm.server_args = types.SimpleNamespace(dp_size=1, enable_dp_attention=False, weight_version="default")
    tm.is_pause = False
    tm.mm_processor = None
    tm.enable_metrics = False
    tm.elastic_worker_count = 1
    tm.startup_time = 0.0
    tm.rid_to_state = {}
    tm.generate_requests: list = []
    tm.model_path = "stand-in"
    loop_box: dict = {}

    def auto_create_handle_loop():
        pass

    def record_config_updates(source, **fields):  # 0.5.2x; 0.5.15 writes server_args.weight_version itself
        if "weight_version" in fields:
            tm.server_args.weight_version = fields["weight_version"]

    def _update_model_path_info(*a, **k):
        pass

    def config_value(name):
        return {"load_format": "auto", "weight_version": tm.server_args.weight_version}.get(name)

    def deliver(out):
        """A scheduler reply reaching the tokenizer manager's result dispatcher (on its event loop)."""
        loop_box["loop"].call_soon_threadsafe(tm._result_dispatcher, out)

    def run_in_scheduler(req):
        out = sched_dispatch(req)
        for deferred in replies:
            deliver(deferred)
        replies.clear()
        if out is not None:
            deliver(out)

    def _dispatch_to_scheduler(req):
        if "loop" not in loop_box:
            loop_box["loop"] = asyncio.get_running_loop()
        threading.Thread(target=run_in_scheduler, args=(req,), daemon=True).start()

    async def _async_dispatch_to_scheduler(req):
        _dispatch_to_scheduler(req)

    def abort_request(rid: str = "", abort_all: bool = False):
        _dispatch_to_scheduler(io_struct.AbortReq(rid=rid, abort_all=abort_all))

    async def get_internal_state():
        return [{"weight_version": tm.server_args.weight_version}]

    async def generate_request(obj, request=None):
        obj.normalize_batch_and_arguments()  # SGLang's own normalizer, the tokenizer manager's first step
        tm.generate_requests.append(obj)
        n = obj.sampling_params.get("max_new_tokens", 1) if isinstance(obj.sampling_params, dict) else 1
        yield {"text": "", "output_ids": [0] * n,
               "meta_info": {"id": obj.rid, "finish_reason": {"type": "length", "length": n},
                             "prompt_tokens": len(obj.input_ids or []), "completion_tokens": n, "cached_tokens": 0,
                             "weight_version": tm.server_args.weight_version,
                             "output_token_logprobs": [[-1.0, 0, None]] * n if obj.return_logprob else None}}

    class LoadReader:
        def read_all(self):
            return [LoadSnapshot(dp_rank=0, num_running_reqs=sched.running, num_waiting_reqs=0)]

        def read(self, dp_rank):
            return self.read_all()[0] if dp_rank == 0 else None

    for name, fn in dict(auto_create_handle_loop=auto_create_handle_loop, record_config_updates=record_config_updates,
                         _update_model_path_info=_update_model_path_info, config_value=config_value,
                         _dispatch_to_scheduler=_dispatch_to_scheduler, abort_request=abort_request,
                         _async_dispatch_to_scheduler=_async_dispatch_to_scheduler,
                         get_internal_state=get_internal_state, generate_request=generate_request).items():
        setattr(tm, name, fn)
    tm.load_snapshot_reader = LoadReader()
    for name in ("pause_generation", "continue_generation", "update_weights_from_disk",
                 "_wait_for_model_update_from_disk", "_handle_update_weights_from_disk_req_output"):
        setattr(tm, name, types.MethodType(getattr(tm_mod.TokenizerManager, name), tm))

    def create_abort_task(obj):
        return None

    tm.create_abort_task = create_abort_task
    tm._result_dispatcher = TypeBasedDispatcher(
        [(io_struct.UpdateWeightFromDiskReqOutput, tm._handle_update_weights_from_disk_req_output)])
    try:
        tm.init_communicators()
    except TypeError:  # 0.5.15 takes the server args
        tm.init_communicators(tm.server_args)

    tm.model_update_lock = None  # made on the server's loop (below)
    tm.is_pause_cond = None
    tm.model_update_tmp = []
    tm.model_update_result = None

    # ---- the HTTP app's global state; SGLang's server-args serialisation stood in --------------------
    @dataclasses.dataclass
    class ServerArgs:
        model_path: str = "stand-in"
        weight_version: str = "default"
        load_format: str = "auto"

        def describe_kv_events_publisher(self):
            return None

    tm.server_args = ServerArgs()
    tm.server_args.dp_size = 1
    tm.server_args.enable_dp_attention = False
    if hasattr(hs, "build_server_info"):
        hs.build_server_info = lambda server_args, scheduler_info: {"model_path": "stand-in"}
    hs.set_global_state(hs._GlobalState(tokenizer_manager=tm, template_manager=None, scheduler_info={}))

    # ---- what a test reads back --------------------------------------------------------------------
    from fastapi import Body

    @hs.app.get("/_contract/state")
    async def contract_state():
        sess = getattr(manager, "_session", None)
        return {"version": version, "stood_in": sglang_stand_ins.stood_in(), "running": sched.running,
                "aborts": sched.aborts, "flushes": sched.flushes, "paused": tm.is_pause,
                "weight_version": tm.server_args.weight_version, "session_open": sess is not None,
                "groups": sorted(_groups(runner)), "disk_loads": list(disk_loads), "loads": model.loads,
                "generate": [_generate_summary(o) for o in tm.generate_requests]}

    @hs.app.get("/_contract/loaded")
    async def contract_loaded():
        return model.digest()

    @hs.app.post("/_contract/running")
    async def contract_running(n: int = Body(..., embed=True)):
        sched.set_running(int(n))
        return {"running": sched.running}

    @hs.app.post("/_contract/reset")
    async def contract_reset():
        model.loaded.clear()
        model.loads = 0
        sched.flushes = sched.aborts = 0
        disk_loads.clear()
        tm.generate_requests.clear()
        return {}

    return hs.app, tm, loop_box


def _groups(runner) -> list:
    wu = getattr(runner, "weight_updater", None)
    groups = getattr(wu, "_model_update_group", None) if wu is not None else None
    if groups is None:
        groups = getattr(runner, "_model_update_group", {})
    return list(groups)


def _generate_summary(obj) -> dict:
    return {"rid": obj.rid, "input_ids": obj.input_ids, "sampling_params": obj.sampling_params,
            "return_logprob": obj.return_logprob, "stream": obj.stream}


def main() -> None:
    args = _args()
    logging.basicConfig(level=logging.WARNING)
    app, tm, loop_box = build(args.site, args.abort_rounds)
    import uvicorn

    async def serve():
        loop_box["loop"] = asyncio.get_running_loop()
        from sglang.srt.utils.aio_rwlock import RWLock

        tm.is_pause_cond = asyncio.Condition()
        tm.model_update_lock = RWLock()
        config = uvicorn.Config(app, host="127.0.0.1", port=args.port, lifespan="off", log_level="warning",
                                access_log=False)
        await uvicorn.Server(config).serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
