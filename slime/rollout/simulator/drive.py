"""The simulator drives the run's real rollout (its step, admission and pause protocol) on simulated engines and
clock: `drive_steps` as train.py, `drive_stream` as train_async.py's stream. Its own: engine and client costs, no
reward, the filter a coin, the trainer a wait."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter

from slime.rollout.buffer import PartialRolloutBuffer
from slime.rollout.length_bias import length_bias_metrics
from slime.rollout.rollout import Rollout
from slime.rollout.simulator.cluster import SimCluster, SimRequester, SimSource
from slime.rollout.step import StepIO
from slime.rollout.stream import StreamRollout
from slime.utils.ledger import TRAINED, group_id

NO_TIMEOUT_S = 1e9  # the simulated step has no wall-clock limits to hit


class Judge:
    """The simulated reward (none) and filter (keeps a group with probability `pass_rate`), counting rejections."""

    def __init__(self, pass_rate: float, seed: int):
        self.pass_rate = pass_rate
        self.rng = random.Random(seed + 1)
        self.rejected = 0
        self.rejected_tokens = 0

    async def reward(self, samples: list) -> None:
        return None

    def filter(self, samples: list, step=None) -> str | None:
        if self.rng.random() < self.pass_rate:
            return None
        self.rejected += 1
        self.rejected_tokens += sum(s.resp_len for s in samples)
        return "filtered"


class Recorder:
    """Per-step records of what the engines and the client did (deltas since the last record)."""

    def __init__(self, cluster: SimCluster):
        self.cluster = cluster
        self.steps: list[dict] = []
        self.ledger: dict[str, int] = {}  # the ledger's counts at the end (Ledger.check_balanced)
        self._mark = self._totals()

    def _totals(self) -> dict:
        c = self.cluster
        engine: dict = {}
        for e in c.engines:
            for k, v in e.stats.items():
                engine[k] = engine.get(k, 0) + v
        return {"busy": c.busy_s(), "requests": c.requests, "reprefill": c.reprefill_tokens, "new": c.new_tokens,
                "engine": engine}

    def record(self, t_start: float, t_end: float, wall_extra: float, t_target: float | None, trained: list,
               version: int, wasted: int, counts: dict, group_finish_t: list[float], dropped: list = ()) -> None:
        now, was = self._totals(), self._mark
        lags: Counter = Counter()
        for g in trained:
            for s in g:
                for v, n in s.version_counts().items():
                    lags[version - v] += n
        masked = sum(s.masked_tokens() for g in trained for s in g)
        rollout = t_end - t_start
        self.steps.append({
            "t_start": t_start, "t_end": t_end, "rollout_s": rollout, "wall_s": rollout + wall_extra,
            "time_to_target_s": (t_target if t_target is not None else t_end) - t_start,
            "new_tokens": now["new"] - was["new"], "wasted_tokens": wasted + masked,
            "trained_tokens": sum(lags.values()), "lag_tokens": dict(lags), "accepted": len(trained),
            "trained_lengths": [s.response_length for g in trained for s in g],
            "busy_s": now["busy"] - was["busy"], "requests": now["requests"] - was["requests"],
            "reprefill_tokens": now["reprefill"] - was["reprefill"], "group_finish_t": group_finish_t,
            "engine": {k: v - was["engine"].get(k, 0) for k, v in now["engine"].items()}, **counts,
            **length_bias_metrics([s for g in trained for s in g], dropped=[s for g in dropped for s in g]),
        })
        self._mark = now


class SimLink:
    """The simulated engines as the run's Rollout sees them: requests through `SimRequester`, judged by `judge`."""

    backend = None
    session = None

    def __init__(self, cluster: SimCluster, judge: Judge, max_response_len: int):
        self.engines, self.judge, self.max_response_len = cluster, judge, max_response_len

    async def worker_urls(self) -> list[str]:
        return self.engines.worker_urls()

    @contextlib.asynccontextmanager
    async def open_step(self, rollout, rollout_id: int, urls: list[str], in_flight_cap: int):
        requester = SimRequester(self.engines, self.max_response_len, rollout_id)
        yield StepIO(buffer=rollout.buffer, data_source=rollout.data_source, engines=self.engines, requester=requester,
                     generate=rollout.requests(requester), reward=self.judge.reward, filter=self.judge.filter)

    def step_metrics(self, record, io) -> dict[str, float]:
        return {}

    async def evaluate(self, rollout_id: int, groups, version: int):
        raise NotImplementedError("the rollout simulator does not evaluate")


async def drive_steps(cfg, cluster: SimCluster, source: SimSource, judge: Judge, recorder: Recorder) -> None:
    """train.py's loop over the run's Rollout (chunked or pool): step, train, push."""
    loop = asyncio.get_running_loop()
    cost = cluster.cost
    buffer = PartialRolloutBuffer()
    rollout = Rollout(cfg.rollout_config(), buffer, source, SimLink(cluster, judge, cfg.max_response_len))
    for step in range(cfg.steps):
        t_start = loop.time()
        await asyncio.sleep(cost.step_overhead_s / 2)  # the step's bookkeeping before its first request
        rejected_tokens = judge.rejected_tokens
        rejected = judge.rejected
        await rollout.step(step)  # (--admission auto's climb learns; auto's over-sampling is not simulated)
        state = rollout.record
        await asyncio.sleep(cost.step_overhead_s / 2)  # and after its drain
        t0 = state.clock.t0
        unfinished = [st.samples for st in state.open_groups() if not all(s.status.is_finished for s in st.samples)]
        stale_ready = [g for g in state.ready_in if state.rejected.get(group_id(g)) == "stale_ready"]
        wasted = (judge.rejected_tokens - rejected_tokens + state.staleness["restarted_tokens"]
                  + sum(s.resp_len for g in stale_ready for s in g)
                  + (0 if cfg.partial_rollout else sum(s.resp_len for g in unfinished for s in g)))
        counts = {"refilled_groups": state.refilled_groups, "finished_groups": state.finished_groups,
                  "parked": state.parked, "discarded": state.discarded, "ready_in": len(state.ready_in),
                  "rejected": judge.rejected - rejected, "stale_ready": len(stale_ready),
                  "resumed_groups": len(state.resumed), "submitted_groups": len(state.groups),
                  "staleness": Counter(state.staleness)}
        target_t = state.clock.marks.get("target")
        recorder.record(t_start, loop.time(), cfg.train_time_s + cost.weight_update_s,
                        t0 + target_t if target_t is not None else None, state.accepted, step, wasted, counts,
                        sorted(t0 + st.finished_t - t_start for st in state.groups.values() if st.finished_t is not None),
                        stale_ready)
        buffer.mark([group_id(g) for g in state.accepted], TRAINED)
        if step + 1 < cfg.steps:
            await asyncio.sleep(cfg.train_time_s)  # training
            async with rollout.updating_weights(step + 1) as flush_cache:  # the push, to idle engines
                await asyncio.sleep(cost.weight_update_s)
                cluster.set_version(step + 1, flush_cache)
    recorder.ledger = buffer.check_balanced()  # (raises if a group was lost or held twice)


async def drive_stream(cfg, cluster: SimCluster, source: SimSource, judge: Judge, recorder: Recorder) -> None:
    """train_async.py's `--rollout-mode stream` over the real `StreamRollout`, pushes in flight."""
    loop = asyncio.get_running_loop()
    buffer = PartialRolloutBuffer()
    rollout = Rollout(cfg.rollout_config(), buffer, source, SimLink(cluster, judge, cfg.max_response_len))
    stream = StreamRollout(rollout, 0, cfg.steps, 0, cfg.max_async_lag)
    await stream.resume()
    t_last = loop.time()
    for j in range(cfg.steps):
        rejected_tokens = judge.rejected_tokens
        rejected = judge.rejected
        out = await stream.take(j, NO_TIMEOUT_S)
        now = loop.time()
        recorder.record(t_last, now, 0.0, now, out.groups, j, judge.rejected_tokens - rejected_tokens,
                        {"rejected": judge.rejected - rejected, "staleness": Counter()}, [])
        t_last = now
        buffer.mark([group_id(g) for g in out.groups], TRAINED)
        if j + 1 == cfg.steps:
            break
        await asyncio.sleep(cfg.train_time_s)  # the trainer trains; the engines go on
        async with rollout.updating_weights(j + 1) as flush_cache:  # the push reaches the engines between two steps,
            cluster.update_weights(j + 1, flush_cache)  # in the mode they were paused in, at the model's cost
    await stream.quiesce()
    recorder.ledger = buffer.check_balanced(idle=False)  # (what the stream still holds in flight stays issued)


__all__ = ["Judge", "Recorder", "SimLink", "drive_steps", "drive_stream"]
