"""Per-step rollout metrics (`rollout/` keys), the engines' monitors (occupancy, watchdog) and the trace file."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from typing import Any

from slime.backends.sglang_utils import engine_api
from slime.backends.sglang_utils.watchdog import EngineWatchdog
from slime.rollout.engine_versions import version_check_metrics
from slime.rollout.length_bias import length_bias_metrics
from slime.rollout.multi_turn.metrics import tool_metrics
from slime.rollout.staleness import STEP_COUNTS
from slime.utils.ledger import group_id, reason_category
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


def token_version_metrics(groups: list[list[Sample]], current_version: int) -> dict[str, float]:
    """Exact off-policy token ratio, staleness histogram and versions per sample (loss-masked tokens)."""
    lags: Counter = Counter()
    distinct: list[int] = []
    for group in groups:
        for s in group:
            for v, c in s.version_counts().items():
                lags[current_version - v] += c
            if s.status.is_finished:
                distinct.append(len(s.version_counts(in_loss_only=False)))
    total = sum(lags.values())
    off = sum(c for lag, c in lags.items() if lag > 0)
    out: dict[str, float] = {
        "rollout/trained_tokens": float(total),
        "rollout/off_policy_tokens": float(off),
        "rollout/off_policy_token_ratio": off / total if total else 0.0,
        "rollout/versions_per_sample_mean": sum(distinct) / len(distinct) if distinct else 0.0,
        "rollout/versions_per_sample_max": float(max(distinct, default=0)),
    }
    for lag in sorted(lags):
        out[f"rollout/staleness_hist/lag_{lag}"] = float(lags[lag])
    return out


def staleness_metrics(counts: Counter, keys: tuple[str, ...], prefix: str = "rollout/staleness_") -> dict[str, float]:
    """What the staleness cap did (its counts, `StalenessCap`'s names), one metric per name in `keys`."""
    return {f"{prefix}{k}": float(counts[k]) for k in keys}


def sample_metrics(groups: list[list[Sample]], reward_key: str | None = None) -> dict[str, float]:
    """Sizes, failures, lengths and rewards of a batch's samples, plus multi-turn and plugin-time metrics."""
    samples = [s for g in groups for s in g]
    n = len(samples)
    rewards = [r for s in samples if (r := s.scalar_reward(reward_key)) is not None]
    outside = [float(s.non_generation_time) for s in samples]
    timing = {"rollout/non_generation_time_mean": sum(outside) / n,
              "rollout/non_generation_time_max": max(outside)} if any(outside) else {}
    return tool_metrics(samples, "rollout/") | version_check_metrics(samples) | timing | {
        "rollout/samples": float(n),
        "rollout/failed_samples": float(sum(s.status == Status.FAILED for s in samples)),
        "rollout/removed_samples": float(sum(bool(s.remove_sample) for s in samples)),
        "rollout/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / n if n else 0.0,
        "rollout/response_len_mean": sum(s.response_length for s in samples) / n if n else 0.0,
        "rollout/response_len_max": float(max((s.response_length for s in samples), default=0)),
        "rollout/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
    }


def running_requests(load: Any) -> tuple[int, int | None]:
    """(running requests, batch capacity or None) from one worker's /v1/loads (or legacy /get_load) reply."""
    return engine_api.running_and_waiting(load)[0], engine_api.running_capacity(load)


class OccupancySampler:
    """Samples every worker's load report (GET /v1/loads?include=core) every `interval` s while a step runs."""

    def __init__(self, session, worker_urls: list[str], interval: float = 0.2):
        self.session, self.urls, self.interval = session, list(worker_urls), interval
        self.running: list[float] = []
        self.fraction: list[float] = []
        self._task: asyncio.Task | None = None
        self._failed = False

    def start(self) -> None:
        if self.urls:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                loads = await engine_api.gather_loads(self.session, self.urls, timeout=5)
            except Exception as e:  # a worker without a load report: stop sampling, say so once
                if not self._failed:
                    logger.info("engine occupancy not sampled (its load report failed: %s)", e)
                self._failed = True
                return
            per = [running_requests(ld) for ld in loads]
            self.running.append(sum(r for r, _ in per) / len(per))
            caps = [c for _, c in per]
            if all(caps):
                self.fraction.append(sum(r for r, _ in per) / sum(caps))
            await asyncio.sleep(self.interval)

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        out = {}
        if self.running:
            out["rollout/engine_running_reqs_mean"] = sum(self.running) / len(self.running)
        if self.fraction:
            out["rollout/engine_occupancy_mean"] = sum(self.fraction) / len(self.fraction)
        return out


class EngineMonitors:
    """Watch the real engines while a step runs: the watchdog (`io.watchdog`) and the occupancy sampler."""

    def __init__(self, args, engines, session, urls: list[str], bar=None):
        self.bar = bar
        self.occupancy = OccupancySampler(session, urls)
        self.watchdog = EngineWatchdog(args, engines, session)
        self.metrics: dict[str, float] = {}

    async def __aenter__(self) -> "EngineMonitors":
        self.occupancy.start()
        self.watchdog.start()
        return self

    async def __aexit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()
        await self.watchdog.stop()
        self.metrics = await self.occupancy.stop()


def append_trace(run_dir: str | None, record: dict[str, Any]) -> None:
    """Append `record` as one JSON line to `<run_dir>/rollout_trace.jsonl` (no-op without run_dir)."""
    if not run_dir:
        return
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "rollout_trace.jsonl"), "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def step_metrics(args, step, requester, occ: dict[str, float]) -> dict[str, float]:
    """The `rollout/` metrics of one finished step (its `StepRecord` and requester counters) and its trace line."""
    m = step.clock.marks
    elapsed = m.get("drained", step.clock.now())
    new_tokens = requester.new_tokens
    out: dict[str, float] = {
        "rollout/new_tokens": float(new_tokens),
        "rollout/tokens_per_s": new_tokens / elapsed if elapsed > 0 else 0.0,
        "rollout/step_time_s": step.clock.now(),
        "rollout/time_to_target_s": m.get("target", m.get("stop", elapsed)),
        "rollout/abort_to_idle_s": step.abort_to_idle,
        "rollout/drain_s": m.get("drained", 0.0) - m.get("stop", 0.0),
        "rollout/requests": float(requester.requests),
        "rollout/in_flight_cap": float(step.in_flight_cap),
        "rollout/in_flight_peak": float(requester.peak_in_flight),
        "rollout/groups_submitted": float(len(step.groups)),
        "rollout/groups_resumed": float(len(step.resumed)),
        "rollout/groups_fresh": float(len(step.groups) - len(step.resumed)),
        "rollout/groups_refilled": float(step.refilled_groups),
        "rollout/groups_finished": float(step.finished_groups),
        "rollout/groups_accepted": float(len(step.accepted)),
        "rollout/groups_ready_in": float(len(step.ready_in)),
        "rollout/groups_ready_out": float(len(step.overflow)),
        "rollout/groups_parked": float(step.parked),
        "rollout/groups_dropped": float(len(step.rejected) + step.discarded),
        "rollout/groups_failed": float(len(step.failed)),
        "rollout/policy_version": float(step.config.policy_version),
    }
    reasons = Counter(reason_category(r) for r in step.rejected.values())
    if step.discarded:
        reasons["discarded_unfinished"] += step.discarded
    for reason, c in reasons.items():
        out[f"rollout/groups_dropped/{reason}"] = float(c)
    out.update(staleness_metrics(step.staleness, STEP_COUNTS))
    if step.chunk is not None:
        out["rollout/over_sampling_batch_size"] = float(step.chunk)
    out.update(token_version_metrics(step.accepted, step.config.policy_version))
    out.update(sample_metrics(step.accepted, args.reward_key))
    out.update(length_bias_metrics(
        [s for g in step.accepted for s in g],
        generated=[s for st in step.groups.values() if st.outcome is not None for s in st.samples],
        dropped=[s for g in step.ready_in if step.rejected.get(group_id(g)) == "stale_ready" for s in g]))
    out.update(occ)
    append_trace(args.run_dir, {
        "rollout_id": step.config.rollout_id, "policy_version": step.config.policy_version, "mode": args.rollout_mode,
        "partial_rollout": step.config.partial, "submitted": list(step.groups), "resumed": step.resumed,
        "abort": step.abort_point, "accepted": [group_id(g) for g in step.accepted],
        "overflow": [group_id(g) for g in step.overflow], "rejected": step.rejected,
        "unfinished": [gid for gid, st in step.groups.items() if st.outcome is None],
        "tokens_per_s": out["rollout/tokens_per_s"], "new_tokens": new_tokens, "step_time_s": round(elapsed, 4),
        **workload_trace(args, step, requester),
    })
    return out


MAX_TIMELINE_POINTS = 500  # per step: a 3000-step run keeps its trace in tens of MB


def workload_trace(args, step, requester) -> dict[str, Any]:
    """The step's workload for the simulator and the plots: sizes, final and unfinished lengths, finish times."""
    finished = [[s.response_length for s in st.samples] for st in step.groups.values() if st.outcome is not None]
    prompts = [st.samples[0].prompt_length for st in step.groups.values()]
    timeline = requester.timeline
    if len(timeline) > MAX_TIMELINE_POINTS:
        k = -(-len(timeline) // MAX_TIMELINE_POINTS)
        timeline = timeline[::k] + [timeline[-1]]
    return {
        "target": step.target, "n_samples_per_prompt": step.config.n, "in_flight_cap": step.in_flight_cap,
        "num_engines": step.config.num_engines, "ignore_eos": bool(args.rollout_ignore_eos),
        "over_sampling_batch_size": step.chunk,
        "max_response_len": int(args.rollout_max_response_len),
        "finished_lengths": finished,
        "unfinished_lengths": [s.response_length for st in step.groups.values() if st.outcome is None
                               for s in st.samples if not s.status.is_finished],
        "prompt_len": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "group_finish_t": sorted(round(st.finished_t, 4) for st in step.groups.values() if st.finished_t is not None),
        "occupancy": [[round(step.clock.at(t), 4), n] for t, n in timeline],
        # the step's own bookkeeping (buffer and data-source calls, commit): before the first request, after the drain
        "first_request_t": round(step.clock.at(timeline[0][0]), 4) if timeline else None,
        "drained_t": round(step.clock.marks.get("drained", 0.0), 4),
    }
