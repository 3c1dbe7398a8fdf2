"""How a step feeds the engines, parked groups first (`take_groups`): `ChunkedSupply` (APRIL) adds
`--over-sampling-batch-size` groups at a time while short of the target; `PoolSupply` (pool, stream segments) keeps
a pool of requests in flight. Neither adds groups while a chunk's worth awaits its reward (a stalled reward would
otherwise let a step generate without bound)."""

from __future__ import annotations

from slime.rollout.buffer import take_groups
from slime.rollout.step_record import RolloutError, StepGroup, StepRecord
from slime.utils.ledger import group_id


async def next_groups(rec: StepRecord, io, num: int) -> list[list]:  # take_groups, recorded in `rec`
    c = rec.config
    parked, fresh, counts = await take_groups(io.buffer, None if rec.exhausted else io.data_source, num, c.n, c.cap,
                                              c.train_version(), c.rpc_timeout)
    rec.staleness.update(counts)
    rec.exhausted = len(parked) + len(fresh) < num
    rec.resumed += [group_id(g) for g in parked]
    for g in parked + fresh:
        gid = group_id(g)
        if gid in rec.groups:
            raise RolloutError(f"group {gid} was handed out twice in step {c.rollout_id}")
        rec.groups[gid] = StepGroup(g)
    return parked + fresh


def _unfinished(groups: list[list]) -> int:
    return sum(1 for g in groups for s in g if not s.status.is_finished)


class Supply:
    """What the step asks a supply: `prepare(num_engines)`, `top_up` at each wake, `gate_closed()`."""

    chunk: int | None = None
    in_flight_cap = 0

    def prepare(self, num_engines: int) -> None:
        return None

    def gate_closed(self):
        return None


class ChunkedSupply(Supply):
    """Over-sampled chunks of `size` groups with top-ups (APRIL), `concurrency_per_engine` in flight."""

    def __init__(self, size: int, concurrency_per_engine: int, top_ups: bool):
        self.chunk, self.concurrency_per_engine = size, concurrency_per_engine
        self.top_ups = top_ups  # --partial-rollout: what is unfinished at the target is parked, not thrown away

    def prepare(self, num_engines: int) -> None:
        self.in_flight_cap = self.concurrency_per_engine * num_engines

    async def top_up(self, rec: StepRecord, io, playing: int, requests: int, awaiting: int) -> list[list]:
        out: list[list] = []
        while not rec.exhausted and playing + len(out) + len(rec.accepted) + len(rec.failed) < rec.target:
            out += await next_groups(rec, io, self.chunk)
        # APRIL keeps the engines full: top up once fewer than a chunk's worth are in flight, unless a chunk's worth
        # already waits for its reward
        budget = min(self.in_flight_cap, self.chunk * rec.config.n)
        free = budget - requests - _unfinished(out)
        if self.top_ups and free > 0 and awaiting < budget and not rec.exhausted:
            refill = await next_groups(rec, io, -(-free // rec.config.n))
            rec.refilled_groups += len(refill)
            out += refill
        return out


class PoolSupply(Supply):
    """`pool_size` requests in flight (CoPRIS), or fewer as `admission` says; `gate`: none added while it is closed."""

    def __init__(self, pool_size: int, gate=None, admission=None):  # admission: slime/rollout/admission.py's
        self.in_flight_cap, self.gate, self.admission = pool_size, gate, admission

    def gate_closed(self):
        return self.gate.wait_open if self.gate is not None and not self.gate.is_open else None

    async def top_up(self, rec: StepRecord, io, playing: int, requests: int, awaiting: int) -> list[list]:
        limit = self.admission.at_wake() if self.admission is not None else self.in_flight_cap
        out: list[list] = []
        if awaiting >= limit:  # the reward is behind, not the engines
            return out
        while (free := limit - requests - _unfinished(out)) > 0 and not rec.exhausted and self.gate_closed() is None:
            out += await next_groups(rec, io, -(-free // rec.config.n))
        return out
