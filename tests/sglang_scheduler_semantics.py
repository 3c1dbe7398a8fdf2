"""SGLang's own scheduler code playing a pause scenario, for `test_sglang_pause_contract.py`.

    python tests/sglang_scheduler_semantics.py --site DIR [--site DIR ...] < scenario.json > observations.json

What runs is SGLang's (the version found in the `--site` folders): `Scheduler.pause_generation` (modes retract,
in_place), `continue_generation`, `flush_cache` and `is_fully_idle`, `_add_request_to_queue`,
`record_weight_version_change` (the live requests' version events), `SchedulerWeightUpdaterManager`'s
`record_weight_version_after_update` and `flush_cache_after_weight_update` (what an update does after loading),
and the per-token version spans a reply carries (`compute_weight_version_spans`, `add_weight_versions_to_meta_info`).

Stood in (what needs a GPU, a model or other processes): the requests (`Req`: an id, its output ids and its
version events), the KV pools and the radix tree (`retract_all` frees a request's KV: recorded), the runtime
configuration (`get_serving` / `get_context`: the weight version; `get_parallel`: one rank), the metrics, the KV
events, and the event loop's forward passes: a `decode` op runs what the loop runs when not paused (`if
self._engine_paused: continue`): the waiting requests are admitted (each gets its first token, as its prefill
samples one) and every running request gets one token per step.

Scenario ops (JSON list): ["run", rid] (admitted, one token), ["queue", rid] (waiting), ["decode", k],
["pause", "retract"|"in_place"], ["continue"], ["update", version, flush_cache], ["flush"], ["finish", rid] (the
reply's meta_info versions, as a finished request's; it leaves). Each op is observed: running and waiting ids
(sorted), paused, every request's token count, and the op's result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--site", action="append", required=True)
    return p.parse_args()


class Req:
    """SGLang's `Req` as the pause, the version events and the spans see it."""

    def __init__(self, rid: str):
        self.rid = rid
        self.output_ids: list[int] = []
        self.weight_version_events: list = []
        self.kv = types.SimpleNamespace(holds_kv=False)
        self.time_stats = types.SimpleNamespace(set_wait_queue_entry_time=lambda: None, set_retract_time=lambda: None)
        self.retracted = 0

    def finished(self) -> bool:
        return False


class Batch:
    def __init__(self):
        self.reqs: list[Req] = []
        self.batch_is_full = False

    def is_empty(self) -> bool:
        return not self.reqs


def build(site_dirs: list[str]):
    for d in reversed(site_dirs):
        sys.path.insert(0, d)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import sglang_stand_ins

    sglang_stand_ins.install()
    from sglang.srt.managers import io_struct
    from sglang.srt.managers import scheduler as sched_mod
    from sglang.srt.managers.scheduler_components import weight_updater as swu
    from sglang.srt.utils import weight_versions as wv

    serving = types.SimpleNamespace(weight_version="10")

    class Context:
        def override(self, _key, weight_version):
            serving.weight_version = weight_version

    freed: list[str] = []

    def retract_all(*, reqs, **_pools):  # the KV pools and the radix tree: a retracted request's KV is freed
        for r in reqs:
            r.retracted += 1
            freed.append(r.rid)

    sched_mod.get_serving = lambda: serving
    sched_mod.get_context = lambda: Context()
    sched_mod.get_parallel = lambda: types.SimpleNamespace(pp_size=1, dp_rank=0)
    sched_mod.retract_all = retract_all

    s = object.__new__(sched_mod.Scheduler)
    none = lambda *a, **k: None  # noqa: E731
    fields = dict(
        _engine_paused=False, _pause_started_at=None, _pause_intervals=[], enable_overlap=False,
        enable_overlap_mlx=False, last_batch=None, running_batch=Batch(), chunked_req=None,
        disaggregation_mode=sched_mod.DisaggregationMode.NULL, decode_offload_manager=None,
        req_to_token_pool=types.SimpleNamespace(clear=none, reset_aux_cache_allocator=none),
        token_to_kv_pool_allocator=types.SimpleNamespace(clear=none), tree_cache=types.SimpleNamespace(reset=none),
        hisparse_coordinator=None, cur_batch_for_debug=None, waiting_queue=[], processed_tokens_counter=0,
        metrics_reporter=types.SimpleNamespace(last_gen_throughput=0.0, current_scheduler_metrics_enabled=False,
                                               reset_metrics=none, is_stats_logging_rank=False),
        kv_events_publisher=types.SimpleNamespace(publish_kv_events=none),
        dllm_manager=types.SimpleNamespace(any_staging_reqs=lambda: False),
        grammar_manager=types.SimpleNamespace(grammar_queue=[], clear=none), enable_hierarchical_cache=False,
        enable_lmcache=False, enable_hisparse=False, draft_worker=None, enable_continuous_input_polling=False,
        # queue admission's priority, queue-limit and storage-prefetch checks (none configured)
        _set_or_validate_priority=lambda req: True, _abort_on_queued_limit=lambda req: False, _prefetch_kvcache=none,
    )
    for k, v in fields.items():
        setattr(s, k, v)
    manager = object.__new__(swu.SchedulerWeightUpdaterManager)
    manager.flush_cache = s.flush_cache
    manager.scheduler = s
    return s, manager, io_struct, wv, serving


def play(ops: list, site_dirs: list[str]) -> list[dict]:
    s, manager, io_struct, wv, serving = build(site_dirs)
    reqs: dict[str, Req] = {}
    out = []
    for op in ops:
        kind, result = op[0], None
        if kind == "run":
            r = reqs[op[1]] = Req(op[1])
            r.output_ids.append(0)  # its prefill sampled the first token
            s.running_batch.reqs.append(r)
        elif kind == "queue":
            reqs[op[1]] = Req(op[1])
            s._add_request_to_queue(reqs[op[1]])
        elif kind == "decode":
            for _ in range(op[1]):
                if s._engine_paused:  # the event loop: nothing runs while paused
                    break
                admitted, s.waiting_queue = s.waiting_queue, []
                for r in admitted:  # prefilled (again, if retracted): its prefill samples a token
                    r.output_ids.append(0)
                for r in s.running_batch.reqs:
                    r.output_ids.append(0)
                s.running_batch.reqs.extend(admitted)
        elif kind == "pause":
            s.pause_generation(io_struct.PauseGenerationReqInput(mode=op[1]))
        elif kind == "continue":
            s.continue_generation(io_struct.ContinueGenerationReqInput())
        elif kind == "update":  # after the load: the version recorded, then the flush (weight_updater.py)
            req = io_struct.UpdateWeightFromDiskReqInput(model_path="stand-in", weight_version=op[1], flush_cache=op[2])
            manager.record_weight_version_after_update(req.weight_version)
            result = manager.flush_cache_after_weight_update(req, True, "ok")[0]
        elif kind == "flush":
            result = s.flush_cache(empty_cache=False)
        elif kind == "finish":
            r = reqs.pop(op[1])
            s.running_batch.reqs = [x for x in s.running_batch.reqs if x is not r]
            s.waiting_queue = [x for x in s.waiting_queue if x is not r]
            spans = wv.compute_weight_version_spans(r.weight_version_events, serving.weight_version, len(r.output_ids))
            meta: dict = {}
            wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(r.output_ids))
            result = {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"],
                      "tokens": len(r.output_ids)}
        else:
            raise ValueError(f"unknown op {op!r}")
        out.append({"op": op, "result": result, "paused": bool(s._engine_paused),
                    "running": sorted(r.rid for r in s.running_batch.reqs),
                    "waiting": sorted(r.rid for r in s.waiting_queue),
                    "tokens": {rid: len(r.output_ids) for rid, r in sorted(reqs.items())}})
    return out


def main() -> None:
    args = _args()
    ops = json.load(sys.stdin)
    json.dump(play(ops, args.site), sys.stdout)


if __name__ == "__main__":
    main()
