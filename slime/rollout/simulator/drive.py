"""The simulator drives the real rollout step (slime/rollout/step.py) against simulated engines on a simulated
clock (clock.py), so a change to the step is a change to the simulation.

- chunked / pool (`drive_steps`): train.py's loop: for each step the engines get the new version (a flush of
  their prefix cache unless `reuse_stale_kv`), the step runs with `ChunkedSupply` or `PoolSupply` and
  `TargetPlacement` against the real partial-rollout buffer (slime/rollout/buffer.py), its accepted groups are
  trained (marked in the ledger), and `train_time_s` plus the weight update pass before the next one.
- stream (`drive_stream`): train_async.py's `--rollout-mode stream`: the real `StreamRollout` with its
  `VersionGate`, its segments run as real steps; a trainer takes each batch, trains for `train_time_s` and
  pushes the next version to the engines while their requests run, as `--pause-mode` says (slime/ray/
  async_rollout.py's `updating_weights`): abort drains the gate (every request aborted, resumed after the
  push), retract / in_place hold new requests back while the engines apply the update with the requests they
  hold (retracted: prefilled again; in place: on their KV).

What stays the simulator's own, and why: the engines, the client's and the router's costs (the cost model);
the reward (none: a simulated sample has no text) and the dynamic filter (a coin with the configured pass
rate); the step's own bookkeeping outside requests (buffer calls, commit: `step_overhead_s`, half before the
first request, half after the drain); the trainer (a wait of `train_time_s`). In stream mode requests are not
aborted by rid when a push makes them stale (the simulated engines abort only all at once).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from slime.rollout.admission import AdmissionControl
from slime.rollout.base_types import RolloutOutput
from slime.rollout.buffer import PartialRolloutBuffer
from slime.rollout.group_outcome import TargetPlacement
from slime.rollout.length_bias import length_bias_metrics
from slime.rollout.simulator.cluster import SimCluster, SimRequester, SimSource
from slime.rollout.staleness import StalenessCap
from slime.rollout.step import StepIO, run_step
from slime.rollout.step_record import StepConfig, step_error
from slime.rollout.step_supply import ChunkedSupply, PoolSupply
from slime.rollout.stream import StreamConfig, StreamRollout
from slime.rollout.version_gate import GatedRequester, VersionGate
from slime.utils.ledger import TRAINED, group_id

NO_TIMEOUT_S = 1e9  # the simulated step has no wall-clock limits to hit


class Judge:
    """The simulated reward (none) and dynamic filter (keeps a group with probability `pass_rate`); counts the
    rejected groups and their tokens."""

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


def _step_config(cfg, cap: StalenessCap, rollout_id: int, version: int, train_version) -> StepConfig:
    return StepConfig(rollout_id=rollout_id, n=cfg.n_samples_per_prompt, partial=cfg.partial_rollout, cap=cap,
                      policy_version=version, train_version=train_version, rpc_timeout=NO_TIMEOUT_S,
                      abort_timeout=NO_TIMEOUT_S, reward_settle_s=NO_TIMEOUT_S, num_engines=cfg.num_engines)


async def drive_steps(cfg, cap: StalenessCap, cluster: SimCluster, source: SimSource, judge: Judge,
                      recorder: Recorder) -> None:
    """train.py's loop over the real step (chunked or pool)."""
    loop = asyncio.get_running_loop()
    cost = cluster.cost
    buffer = PartialRolloutBuffer()
    if cfg.mode == "chunked":
        supply = ChunkedSupply(cfg.chunk, cfg.concurrency_per_engine,
                               top_ups=cfg.partial_rollout and cfg.top_ups)
    else:
        supply = PoolSupply(cfg.pool_size, admission=admission_of(cfg))
    between = cfg.train_time_s + cost.weight_update_s
    for step in range(cfg.steps):
        cluster.set_version(step, flush=not cfg.reuse_stale_kv)  # the new weights: the engines are idle
        t_start = loop.time()
        await asyncio.sleep(cost.step_overhead_s / 2)  # the step's bookkeeping before its first request
        rejected_tokens = judge.rejected_tokens
        rejected = judge.rejected
        requester = SimRequester(cluster, cfg.max_response_len, step)
        io = StepIO(buffer=buffer, data_source=source, engines=cluster, requester=requester,
                    generate=requester.generate, reward=judge.reward, filter=judge.filter)
        supply.prepare(cfg.num_engines)
        state = await run_step(io, _step_config(cfg, cap, step, step, lambda step=step: step), supply,
                               TargetPlacement(cfg.rollout_batch_size))
        error = step_error(state)
        if error is not None:
            raise error
        await supply.after_step(state, cluster)  # (--admission auto's climb; auto's over-sampling is not simulated)
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
        recorder.record(t_start, loop.time(), between, t0 + target_t if target_t is not None else None,
                        state.accepted, step, wasted, counts,
                        sorted(t0 + st.finished_t - t_start for st in state.groups.values() if st.finished_t is not None),
                        stale_ready)
        buffer.mark([group_id(g) for g in state.accepted], TRAINED)
        if step + 1 < cfg.steps:
            await asyncio.sleep(between)  # training and the weight update
    recorder.ledger = buffer.check_balanced()  # (raises if a group was lost or held twice)


async def drive_stream(cfg, cap: StalenessCap, cluster: SimCluster, source: SimSource, judge: Judge,
                       recorder: Recorder) -> None:
    """train_async.py's `--rollout-mode stream` over the real `StreamRollout`, pushes in flight (`push_in_flight`)."""
    loop = asyncio.get_running_loop()
    buffer = PartialRolloutBuffer()
    gate = VersionGate(0, train_version=0)

    async def run_segment(rollout_id: int, supply, placement, halt: asyncio.Event, on_io) -> RolloutOutput:
        requester = SimRequester(cluster, cfg.max_response_len, rollout_id)
        io = StepIO(buffer=buffer, data_source=source, engines=cluster, requester=requester,
                    generate=GatedRequester(requester, gate, cap).generate, reward=judge.reward, filter=judge.filter)
        on_io(io)
        supply.prepare(cfg.num_engines)
        state = await run_step(io, _step_config(cfg, cap, rollout_id, gate.train_version, lambda: gate.train_version),
                               supply, placement, halt=halt)
        error = step_error(state)
        if error is not None:
            raise error
        return RolloutOutput(groups=[], metrics={"rollout/halted": 1.0} if state.halted else {})

    admission = admission_of(cfg)
    stream = StreamRollout(StreamConfig(cfg.rollout_batch_size, cfg.max_async_lag, cfg.pool_size, cap, NO_TIMEOUT_S,
                                        admission),
                           run_segment, gate, buffer, cluster, 0, cfg.steps, 0)
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
        await push_in_flight(cfg, cluster, gate, stream, j + 1)
    await stream.quiesce()
    recorder.ledger = buffer.check_balanced(idle=False)  # (what the stream still holds in flight stays issued)


def admission_of(cfg) -> AdmissionControl:
    """The pool's --admission, as the run makes it (AdmissionControl.from_args)."""
    return AdmissionControl(cfg.admission, cfg.pool_size, cfg.n_samples_per_prompt,
                            cfg.rollout_batch_size * cfg.n_samples_per_prompt)


async def push_in_flight(cfg, cluster: SimCluster, gate: VersionGate, stream: StreamRollout, version: int) -> None:
    """train_async.py's push while requests run (`AsyncRollout.updating_weights`), per `cfg.pause_mode`."""
    loop = asyncio.get_running_loop()
    update = (version, not cfg.reuse_stale_kv and cfg.pause_mode != "in_place", cluster.cost.weight_update_s)
    if cfg.pause_mode == "abort":
        await gate.hold("update", cluster, timeout=NO_TIMEOUT_S)  # every request aborted and back at the gate
        cluster.command_all(loop.time(), "update", (*update, "in_place"))  # (nothing runs to keep)
        gate.set_version(version)
    else:
        gate.begin_update(version)
        await gate.hold("update", cluster, drain=False)  # nothing new is sent; the engines keep what runs
        cluster.command_all(loop.time(), "update", (*update, cfg.pause_mode))
        gate.end_update()
    await stream.rebalance()
    gate.release("update")


__all__ = ["Judge", "Recorder", "drive_steps", "drive_stream", "push_in_flight"]
