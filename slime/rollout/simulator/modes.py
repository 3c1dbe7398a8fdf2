"""The rollout side of the simulator: how each mode feeds the engines (mirrors slime/rollout).

- `ChunkedStep`: `--rollout-mode chunked` (sync when over-sampling = batch without
  `--partial-rollout`; APRIL with any over-sampling size, chunks smaller than the batch included):
  submit chunks of groups (parked first, then fresh) while groups in play + accepted < target, at
  most `concurrency` requests in flight; stop at the target, abort, park (or drop) the unfinished,
  keep groups finished after the target for the next step.
- `PoolStep`: `--rollout-mode pool`: `pool_size` workers each generating the next unfinished
  sample; the first fetch fills the pool, later ones take one group at a time.
- `AsyncRun`: fully asynchronous (stream): `pool_size` requests in flight across steps, the trainer takes the
  next `rollout_batch_size` accepted groups as they finish, weight updates reach the engines while
  requests run, and the rollout stops starting groups while `max_async_lag` batches wait.

`RolloutState` is what lives across steps: the parked and finished-early groups, the fresh-group
supply and the policy version.
"""

from __future__ import annotations

import functools
import random
from collections import Counter, deque

from slime.rollout.simulator.engine import EventLoop, SimEngine, SimRequest, SimSample


class SimGroup:
    __slots__ = ("gid", "samples", "outcome", "outstanding", "resumed", "finished_t")

    def __init__(self, gid: int, samples: list[SimSample]):
        self.gid, self.samples = gid, samples
        self.outcome: str | None = None
        self.outstanding = 0
        self.resumed = False
        self.finished_t: float | None = None

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.samples)


class Cluster:
    """The engines behind a round-robin router, and the client's view of requests."""

    def __init__(self, loop: EventLoop, engines: list[SimEngine]):
        self.loop, self.engines = loop, engines
        self.rr = 0
        self.seq = 0
        self.in_flight = 0
        self.requests = 0
        self.reprefill_tokens = 0
        self.timeline: list[tuple[float, int]] | None = None
        self.client_free_at = 0.0  # the client sends one request after another

    def send(self, t: float, sample: SimSample, on_done) -> None:
        """The client sends `sample`'s request (after the work it already has queued); `on_done(t, req,
        segments, finished)` runs when the client has read the reply."""
        eng = self.engines[self.rr % len(self.engines)]
        cost = eng.cost
        t = max(t, self.client_free_at) + cost.client_per_request_s / 2
        self.client_free_at = t
        self.rr += 1
        self.seq += 1
        self.requests += 1
        if sample.resp_len:
            self.reprefill_tokens += sample.tokens
        self.in_flight += 1
        if self.timeline is not None:
            self.timeline.append((t, self.in_flight))
        req = SimRequest(self.seq, sample, t + cost.request_latency_s / 2, functools.partial(self._receive, on_done))
        self.loop.at(req.arrive_t, eng.deliver, "request", req)

    def _receive(self, on_done, t: float, req: SimRequest, segs, finished: bool) -> None:
        """A reply reaches the client, which reads it (per request and per token) when it is free."""
        cost = self.engines[0].cost
        t = max(t, self.client_free_at) + cost.client_per_request_s / 2 + cost.client_per_token_s * sum(n for _, n in segs)
        self.client_free_at = t
        self.loop.at(t, on_done, req, segs, finished)

    def returned(self, t: float) -> None:
        self.in_flight -= 1
        if self.timeline is not None:
            self.timeline.append((t, self.in_flight))

    def command_all(self, t: float, kind: str, payload=None) -> None:
        for eng in self.engines:
            self.loop.at(t, eng.deliver, kind, payload)

    def busy_s(self) -> float:
        return sum(e.busy_s() for e in self.engines)


class RolloutState:
    """Parked groups (FIFO), groups finished after a target (returned first next step), fresh supply."""

    def __init__(self, lengths, n: int, max_response_len: int, seed: int, budgets_are_lengths: bool = False):
        self.lengths, self.n, self.max_len = lengths, n, max_response_len
        self.rng = random.Random(seed)
        self.filter_rng = random.Random(seed + 1)
        self.budgets_are_lengths = budgets_are_lengths
        self.parked: deque[SimGroup] = deque()
        self.ready: list[SimGroup] = []
        self.next_gid = 0
        self.next_sid = 0
        self.version = 0

    def fresh(self, num: int) -> list[SimGroup]:
        out = []
        for _ in range(num):
            prompt, lens = self.lengths.sample_group(self.rng, self.n)
            samples = []
            for x in lens:
                budget = min(self.max_len, x) if self.budgets_are_lengths else self.max_len
                samples.append(SimSample(self.next_sid, self.next_gid, prompt, min(x, self.max_len), budget))
                self.next_sid += 1
            out.append(SimGroup(self.next_gid, samples))
            self.next_gid += 1
        return out

    def take_parked(self, num: int) -> list[SimGroup]:
        out = []
        while self.parked and len(out) < num:
            out.append(self.parked.popleft())
        return out


class StepCounters:
    """What one step (or one trainer step in stream mode) did."""

    def __init__(self, t_start: float):
        self.t_start = t_start
        self.t_target: float | None = None
        self.t_end: float | None = None
        self.new_tokens = 0
        self.wasted_tokens = 0  # restarted, masked, in rejected or discarded groups
        self.accepted: list[SimGroup] = []
        self.counts: Counter = Counter()
        self.lag_tokens: Counter = Counter()
        self.group_finish_t: list[float] = []


def apply_staleness(groups: list[SimGroup], version: int, max_staleness: int | None, policy: str,
                    counters: StepCounters) -> None:
    """`slime/rollout/staleness.py` on simulated samples: restart / mask / keep stale unfinished ones."""
    if max_staleness is None:
        return
    floor = version - max_staleness
    for g in groups:
        for s in g.samples:
            oldest = s.oldest_version()
            if s.finished or oldest is None or oldest >= floor:
                continue
            counters.counts[f"staleness_{policy}"] += 1
            if policy == "restart":
                n = s.reset()
                counters.wasted_tokens += n
                counters.counts["restarted_tokens"] += n
            elif policy == "mask":
                masked = sum(c for v, c in s.segments if v < floor)
                counters.counts["masked_tokens"] += masked


def record_trained(groups: list[SimGroup], version: int, max_staleness: int | None, policy: str,
                   counters: StepCounters) -> None:
    """Per-token lag histogram of the trained groups (masked tokens are not trained)."""
    floor = None if (max_staleness is None or policy != "mask") else version - max_staleness
    for g in groups:
        for s in g.samples:
            for v, c in s.segments:
                if floor is not None and v < floor:
                    counters.wasted_tokens += c
                    continue
                counters.lag_tokens[version - v] += c


class _StepBase:
    """Shared by chunked and pool steps: group bookkeeping, the filter, the stop and the commit."""

    def __init__(self, cfg, cluster: Cluster, state: RolloutState, t0: float, on_end):
        self.cfg, self.cluster, self.state, self.on_end = cfg, cluster, state, on_end
        self.c = StepCounters(t0)
        self.target = cfg.rollout_batch_size
        self.groups: dict[int, SimGroup] = {}
        self.accepted: list[SimGroup] = []
        self.overflow: list[SimGroup] = []
        self.stopped = False
        self.outstanding = 0
        self.exhausted = False
        self.version = state.version
        self.cost = cluster.engines[0].cost

    def take_ready(self) -> None:
        ready, self.state.ready = self.state.ready[: self.target], self.state.ready[self.target:]
        floor = None if self.cfg.max_staleness is None else self.version - self.cfg.max_staleness
        for g in ready:
            if floor is not None and any(v < floor for s in g.samples for v, _ in s.segments):
                self.c.counts["stale_ready"] += 1  # finished at an older policy than the cap allows: dropped
                self.c.wasted_tokens += sum(s.resp_len for s in g.samples)
            else:
                self.accepted.append(g)
        self.c.counts["ready_in"] = len(ready)

    def next_groups(self, num: int) -> list[SimGroup]:
        parked = self.state.take_parked(num)
        apply_staleness(parked, self.version, self.cfg.max_staleness, self.cfg.staleness_policy, self.c)
        for g in parked:
            g.resumed = True
            g.outcome = None
        out = parked + (self.state.fresh(num - len(parked)) if len(parked) < num else [])
        for g in out:
            self.groups[g.gid] = g
        self.c.counts["resumed_groups"] += len(parked)
        self.c.counts["submitted_groups"] += len(out)
        return out

    def active(self) -> int:
        return sum(1 for g in self.groups.values() if g.outcome is None)

    def response(self, t: float, req: SimRequest, segs, finished: bool) -> bool:
        """Account a returned request; True if its sample finished (its group may have finished)."""
        self.cluster.returned(t)
        self.outstanding -= 1
        s = req.sample
        s.add(segs)
        self.c.new_tokens += sum(n for _, n in segs)
        if not finished:
            return False
        g = self.groups[s.gid]
        g.outstanding -= 1
        if g.outstanding == 0:
            self.group_generated(t, g)
        return True

    def group_generated(self, t: float, g: SimGroup) -> None:
        self.c.counts["groups_finished"] += 1
        self.c.group_finish_t.append(t - self.c.t_start)
        g.finished_t = t
        if self.state.filter_rng.random() >= self.cfg.pass_rate:
            g.outcome = "rejected"
            self.c.counts["rejected"] += 1
            self.c.wasted_tokens += sum(s.resp_len for s in g.samples)
        elif len(self.accepted) < self.target and not self.stopped:
            g.outcome = "accepted"
            self.accepted.append(g)
            if len(self.accepted) >= self.target:
                self.stop(t)
        else:
            g.outcome = "overflow"
            self.overflow.append(g)

    def stop(self, t: float) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.c.t_target = t
        self.cluster.command_all(t + self.cost.abort_s, "abort")
        self._t_abort_done = t + self.cost.abort_s + self.cost.request_latency_s
        self.cluster.loop.at(self._t_abort_done, self._maybe_end)

    def _maybe_end(self, t: float) -> None:
        if not self.stopped or self.outstanding > 0 or t < self._t_abort_done or self.c.t_end is not None:
            return
        self.commit()
        self.c.t_end = t + self.cost.step_overhead_s / 2
        self.cluster.loop.at(self.c.t_end, lambda tt: self.on_end(tt, self))

    def commit(self) -> None:
        st, c = self.state, self.c
        unfinished = [g for g in self.groups.values() if g.outcome is None and not g.all_finished]
        if self.cfg.partial_rollout:
            st.parked.extend(unfinished)
            c.counts["parked"] = len(unfinished)
        else:
            c.counts["discarded"] = len(unfinished)
            c.wasted_tokens += sum(s.resp_len for g in unfinished for s in g.samples)
        st.ready.extend(self.overflow)
        c.accepted = self.accepted
        record_trained(self.accepted, self.version, self.cfg.max_staleness, self.cfg.staleness_policy, c)


class ChunkedStep(_StepBase):
    def start(self, t: float) -> None:
        self.concurrency = self.cfg.concurrency_per_engine * len(self.cluster.engines)
        self.queue: deque[SimSample] = deque()
        t += self.cost.step_overhead_s / 2  # before the first request (the rest after the drain)
        self.take_ready()
        self.progress(t)

    def progress(self, t: float) -> None:
        if self.stopped:
            return
        if len(self.accepted) >= self.target:
            self.stop(t)
            return
        while not self.exhausted and self.active() + len(self.accepted) < self.target:
            for g in self.next_groups(self.cfg.chunk):
                self.begin(t, g)
        # APRIL's top-ups (slime/rollout/sglang_rollout.py): with --partial-rollout, as soon as fewer requests
        # are in flight or queued than a chunk's worth (at most the concurrency), take parked, then fresh groups
        free = min(self.concurrency, self.cfg.chunk * self.state.n) - (self.outstanding + len(self.queue))
        if self.cfg.partial_rollout and self.cfg.top_ups and free > 0 and not self.exhausted and not self.stopped:
            groups = self.next_groups(-(-free // self.state.n))
            self.c.counts["refill_groups"] += len(groups)
            for g in groups:
                self.begin(t, g)
        if self.stopped:
            return
        if self.active() == 0:
            self.stop(t)

    def begin(self, t: float, g: SimGroup) -> None:
        todo = [s for s in g.samples if not s.finished]
        g.outstanding = len(todo)
        if not todo:
            self.group_generated(t, g)
            return
        for s in todo:
            self.queue.append(s)
        self.pump(t)

    def pump(self, t: float) -> None:
        while self.queue and self.outstanding < self.concurrency and not self.stopped:
            self.outstanding += 1
            self.cluster.send(t, self.queue.popleft(), self.on_response)

    def on_response(self, t: float, req, segs, finished: bool) -> None:
        self.response(t, req, segs, finished)
        if self.stopped:
            self._maybe_end(t)
            return
        self.pump(t)
        self.progress(t)


class PoolStep(_StepBase):
    def start(self, t: float) -> None:
        t += self.cost.step_overhead_s / 2  # before the first request (the rest after the drain)
        self.take_ready()
        self.queue: deque[SimSample] = deque()
        self.next_fetch = max(1, -(-self.cfg.pool_size // self.state.n))
        if len(self.accepted) >= self.target:
            self.stop(t)
            return
        for _ in range(self.cfg.pool_size):
            self.worker(t)

    def next_item(self, t: float) -> SimSample | None:
        while not self.queue:
            if self.stopped or self.exhausted:
                return None
            num, self.next_fetch = self.next_fetch, 1
            for g in self.next_groups(num):
                todo = [s for s in g.samples if not s.finished]
                g.outstanding = len(todo)
                if not todo:
                    self.group_generated(t, g)
                self.queue.extend(todo)
        return self.queue.popleft()

    def worker(self, t: float) -> None:
        if self.stopped:
            return
        s = self.next_item(t)
        if s is None or self.stopped:
            return
        self.outstanding += 1
        self.cluster.send(t, s, self.on_response)

    def on_response(self, t: float, req, segs, finished: bool) -> None:
        self.response(t, req, segs, finished)
        if self.stopped:
            self._maybe_end(t)
            return
        self.worker(t)
