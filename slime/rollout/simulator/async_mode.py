"""Fully asynchronous rollout in the simulator: mode "stream", train_async.py's `--rollout-mode stream`.

Engines keep `pool_size` requests in flight across steps (nothing is aborted between steps); a
finished group that passes the filter joins a queue; the trainer takes the next
`rollout_batch_size` groups as soon as it is idle and they are there, trains for `train_time_s`,
then sends the new weights to the engines, which apply them between two decode steps while their
requests run (later tokens carry the new version). The rollout runs ahead of the trainer by at
most `max_async_lag` batches: while that many accepted batches wait, no new group is started (the
requests in flight go on). That is the real stream's backpressure (slime/rollout/stream.py) with updates
as `--in-flight-update in_place` applies them; it does not model `abort` mode's abort + resume cost.
"""

from __future__ import annotations

from collections import deque

from slime.rollout.simulator.modes import Cluster, RolloutState, SimGroup, StepCounters, record_trained


class AsyncRun:
    def __init__(self, cfg, cluster: Cluster, state: RolloutState, on_step):
        self.cfg, self.cluster, self.state, self.on_step = cfg, cluster, state, on_step
        self.cost = cluster.engines[0].cost
        self.target = cfg.rollout_batch_size
        self.ready: deque[SimGroup] = deque()
        self.groups: dict[int, SimGroup] = {}
        self.samples: deque = deque()
        self.first_fetch = max(1, -(-cfg.pool_size // state.n))
        self.trainer_busy = False
        self.stalled = 0
        self.done = False
        self.c = StepCounters(0.0)
        self.trained_steps = 0

    def start(self, t: float) -> None:
        for _ in range(self.cfg.pool_size):
            self.worker(t)

    def _room(self) -> bool:
        return len(self.ready) < self.cfg.max_async_lag * self.target

    def worker(self, t: float) -> None:
        if self.done:
            return
        if not self.samples:
            if not self._room():
                self.stalled += 1
                return
            num, self.first_fetch = self.first_fetch, 1
            for g in self.state.fresh(num):
                self.groups[g.gid] = g
                g.outstanding = len(g.samples)
                self.samples.extend(g.samples)
        self.cluster.send(t, self.samples.popleft(), self.on_response)

    def on_response(self, t: float, req, segs, finished: bool) -> None:
        self.cluster.returned(t)
        s = req.sample
        s.add(segs)
        self.c.new_tokens += sum(n for _, n in segs)
        if not finished:  # only a shutdown aborts in this mode
            return
        g = self.groups[s.gid]
        g.outstanding -= 1
        if g.outstanding == 0:
            del self.groups[g.gid]
            self.c.counts["groups_finished"] += 1
            if self.state.filter_rng.random() >= self.cfg.pass_rate:
                self.c.counts["rejected"] += 1
                self.c.wasted_tokens += sum(x.resp_len for x in g.samples)
            else:
                self.ready.append(g)
                self.maybe_train(t)
        self.worker(t)

    def maybe_train(self, t: float) -> None:
        if self.trainer_busy or len(self.ready) < self.target or self.done:
            return
        batch = [self.ready.popleft() for _ in range(self.target)]
        c = self.c
        c.accepted = batch
        record_trained(batch, self.state.version, None, "keep", c)
        c.t_end = c.t_target = t
        self.trainer_busy = True
        self.c = StepCounters(t)
        self.trained_steps += 1
        self.on_step(t, c)
        if self.trained_steps >= self.cfg.steps:
            self.done = True
            self.cluster.command_all(t, "abort")
            return
        while self.stalled and self._room():  # the queue has room again: stalled workers start groups
            self.stalled -= 1
            self.worker(t)
        self.cluster.loop.at(t + self.cfg.train_time_s, self.trained)

    def trained(self, t: float) -> None:
        self.state.version += 1
        self.cluster.command_all(t, "update", (self.state.version, not self.cfg.reuse_stale_kv, self.cost.weight_update_s))
        self.trainer_busy = False
        self.maybe_train(t)
