"""What the real rollout step talks to in the simulator: `SimCluster` (the simulated engines behind a round-robin
router, seen as the step sees an `EngineGroup`, plus the client as one serial resource), `SimRequester` (the step's
request loop sending to them), `SimSample` and `SimSource` (prompt groups drawn from a length model)."""

from __future__ import annotations

import asyncio
import functools
import random
from collections import Counter

from slime.rollout.sampling_request import RequestLoop
from slime.rollout.simulator.engine import EventLoop, SimEngine, SimRequest
from slime.utils.types import Status


class SimSample:
    """One sample's progress as runs of (version, tokens), answering what the rollout reads of a `Sample`."""

    __slots__ = ("index", "group_index", "prompt_len", "final_len", "budget", "resp_len", "segments", "kv",
                 "status", "metadata", "reward", "masked_below")
    remove_sample, non_generation_time = False, 0.0  # upstream's plugin fields: no plugin runs here

    def __init__(self, sid: int, gid: int, prompt_len: int, final_len: int, budget: int):
        self.index, self.group_index, self.prompt_len = sid, gid, prompt_len
        self.final_len, self.budget = min(final_len, budget), budget
        self.resp_len = 0
        self.segments: list[list[int]] = []  # [version, tokens]
        self.kv: tuple[int, int] | None = None  # (engine id, cached tokens) of its last abort
        self.status = Status.PENDING
        self.metadata = {"max_response_len": budget}
        self.reward = None
        self.masked_below: int | None = None  # tokens of older versions are out of the loss

    @property
    def sid(self) -> int:
        return self.index

    @property
    def gid(self) -> int:
        return self.group_index

    @property
    def n_tokens(self) -> int:
        return self.prompt_len + self.resp_len

    @property
    def response_length(self) -> int:
        return self.resp_len

    @property
    def prompt_length(self) -> int:
        return self.prompt_len

    def add(self, segments: list[tuple[int, int]]) -> None:
        for version, n in segments:
            if n <= 0:
                continue
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += n
            else:
                self.segments.append([version, n])
            self.resp_len += n

    # ---- what the step reads of a Sample -----------------------------------------------------
    def reset_response(self) -> None:
        """Drop the response (a staleness restart)."""
        self.resp_len, self.segments, self.kv, self.masked_below = 0, [], None, None
        self.status = Status.PENDING

    def oldest_version(self) -> int | None:
        return min(v for v, _ in self.segments) if self.segments else None

    def newest_version(self) -> int | None:
        return max(v for v, _ in self.segments) if self.segments else None

    def _masked(self, version: int) -> bool:
        return self.masked_below is not None and version < self.masked_below

    def mask_tokens_older_than(self, min_version: int) -> int:
        masked = sum(n for v, n in self.segments if v < min_version and not self._masked(v))
        self.masked_below = max(min_version, self.masked_below if self.masked_below is not None else min_version)
        return masked

    def loss_tokens_older_than(self, min_version: int) -> int:
        return sum(n for v, n in self.segments if v < min_version and not self._masked(v))

    def version_counts(self, in_loss_only: bool = True) -> Counter:
        out: Counter = Counter()
        for v, n in self.segments:
            if not (in_loss_only and self._masked(v)):
                out[v] += n
        return out

    def masked_tokens(self) -> int:
        return sum(n for v, n in self.segments if self._masked(v))

    def scalar_reward(self, reward_key=None):
        return None


class SimCluster:
    router_url = "sim://router"

    def __init__(self, events: EventLoop, engines: list[SimEngine]):
        self.events, self.engines = events, engines
        self.cost = engines[0].cost
        self.rr = 0
        self.seq = 0
        self.in_flight = 0
        self.requests = 0
        self.new_tokens = 0
        self.reprefill_tokens = 0
        self.timeline: list[tuple[float, int]] | None = None  # (t, requests in flight), the client's view
        self.client_free_at = 0.0  # the client sends one request after another
        self._retractions_seen: dict[int, int] = {}  # per engine, for the load reports' retraction counts
        self.paused: str | None = None  # the mode the engines were paused in (retract | in_place), until continued
        self._by_rid: dict[str, tuple[SimEngine, SimRequest]] = {}  # requests in flight sent with a rid

    # ---- as the step sees an EngineGroup -----------------------------------------------------
    def worker_urls(self) -> list[str]:
        return [f"sim://engine-{e.eid}" for e in self.engines]

    async def abort_all_until_idle(self, timeout: float = 0.0, session=None, exclude=frozenset()) -> float:
        """Abort-all reaches every engine `abort_s` from now; the engines are idle once its reply is back."""
        t = self.events.now
        self.command_all(t + self.cost.abort_s, "abort")
        took = self.cost.abort_s + self.cost.request_latency_s
        await asyncio.sleep(took)
        return took

    async def pause(self, mode: str, session=None) -> None:
        """SGLang's /pause_generation: the engines hold what runs until the update, taken in `mode`."""
        self.paused = mode

    async def continue_generation(self, session=None) -> None:
        self.paused = None

    def update_weights(self, version: int, flush: bool) -> None:
        """The trainer's push reaches every engine now: taken between two of its steps, in the mode it was paused
        in (nothing running: as in place), at the cost model's `weight_update_s`."""
        self.command_all(self.events.now, "update", (version, flush, self.cost.weight_update_s, self.paused or "in_place"))

    async def abort_requests(self, rids: list[str], session=None) -> None:
        """POST /abort_request {"rid"} for each: the request ends at its engine, its reply saying what it produced."""
        t = self.events.now + self.cost.request_latency_s / 2
        for rid in rids:
            if rid in self._by_rid:
                eng, req = self._by_rid[rid]
                self.events.at(t, eng.deliver, "abort_request", req)
        await asyncio.sleep(self.cost.request_latency_s)

    async def loads(self, session=None) -> list[dict]:
        """Every engine's load report as SGLang's /v1/loads shapes it (running, waiting, KV token usage, the engine's
        batch capacity, retractions since the last report), read after one request's latency (--admission auto)."""
        await asyncio.sleep(self.cost.request_latency_s)
        out = []
        for e in self.engines:
            retracted = e.stats["retractions"] - self._retractions_seen.get(e.eid, 0)
            self._retractions_seen[e.eid] = e.stats["retractions"]
            out.append({"num_running_reqs": len(e.running) + len(e.prefilling), "num_waiting_reqs": len(e.waiting),
                        "token_usage": e.token_usage(), "max_running_requests": self.cost.max_running,
                        "queues": {"retracted": retracted}})
        return out

    # ---- the client -------------------------------------------------------------------------
    def request(self, sample: SimSample, rid: str | None = None) -> asyncio.Future:
        """Send `sample`'s request now (after the client's queued work); resolves to (segments, finished) once
        the client has read the reply (`rid`: so it can be aborted by it)."""
        fut = self.events.aloop.create_future()
        eng = self.engines[self.rr % len(self.engines)]
        cost = eng.cost
        t = max(self.events.now, self.client_free_at) + cost.client_per_request_s / 2 \
            + cost.client_per_input_token_s * sample.n_tokens
        self.client_free_at = t
        self.rr += 1
        self.seq += 1
        self.requests += 1
        if sample.resp_len:
            self.reprefill_tokens += sample.n_tokens
        self.in_flight += 1
        if self.timeline is not None:
            self.timeline.append((t, self.in_flight))
        req = SimRequest(self.seq, sample, t + cost.request_latency_s / 2, functools.partial(self._receive, fut, rid))
        if rid is not None:
            self._by_rid[rid] = (eng, req)
        self.events.at(req.arrive_t, eng.deliver, "request", req)
        return fut

    def _receive(self, fut: asyncio.Future, rid: str | None, t: float, req: SimRequest, segs, finished: bool) -> None:
        """A reply reaches the client, which reads it (per request and per token) when it is free."""
        self._by_rid.pop(rid, None)
        t = max(t, self.client_free_at) + self.cost.client_per_request_s / 2 \
            + self.cost.client_per_token_s * sum(n for _, n in segs)
        self.client_free_at = t
        self.events.at(t, self._read, fut, segs, finished)

    def _read(self, t: float, fut: asyncio.Future, segs, finished: bool) -> None:
        self.in_flight -= 1
        self.new_tokens += sum(n for _, n in segs)
        if self.timeline is not None:
            self.timeline.append((t, self.in_flight))
        fut.set_result((segs, finished))

    # ---- commands ----------------------------------------------------------------------------
    def command_all(self, t: float, kind: str, payload=None) -> None:
        for eng in self.engines:
            self.events.at(t, eng.deliver, kind, payload)

    def set_version(self, version: int, flush: bool) -> None:
        """New weights while the engines are idle (between synchronous steps)."""
        for e in self.engines:
            e.version = version
            if flush:
                e.cache.clear()

    def busy_s(self) -> float:
        return sum(e.busy_s() for e in self.engines)


class SimRequester(RequestLoop):
    """The step's request loop, each request sent to the simulated engines."""

    def __init__(self, cluster: SimCluster, max_response_len: int, rollout_id: int = 0):
        super().__init__(max_response_len, rollout_id)
        self.cluster = cluster

    async def send(self, sample: SimSample, rid: str | None = None, window=None) -> int:
        # (the simulated engines tag every token with the version that produced it: nothing to check)
        self.requests += 1
        self._in_flight(+1)
        try:
            segs, finished = await self.cluster.request(sample, rid)
        finally:
            self._in_flight(-1)
        sample.add(segs)
        got = sum(n for _, n in segs)
        self.new_tokens += got
        if finished:
            sample.status = Status.TRUNCATED if sample.resp_len >= sample.budget else Status.COMPLETED
        else:
            sample.status = Status.ABORTED
        return got


class SimSource:
    """Fresh groups of `n` samples from `lengths` (each sample's final length drawn, its budget the cap, or its
    length with `budgets_are_lengths`: ignore_eos benchmarks)."""

    def __init__(self, lengths, n: int, max_response_len: int, seed: int, budgets_are_lengths: bool = False):
        self.lengths, self.n, self.max_len = lengths, n, max_response_len
        self.rng = random.Random(seed)
        self.budgets_are_lengths = budgets_are_lengths
        self.next_gid = 0
        self.next_sid = 0

    def get_groups(self, num: int) -> list[list[SimSample]]:
        out = []
        for _ in range(num):
            prompt, lens = self.lengths.sample_group(self.rng, self.n)
            group = []
            for x in lens:
                budget = min(self.max_len, x) if self.budgets_are_lengths else self.max_len
                group.append(SimSample(self.next_sid, self.next_gid, prompt, min(x, self.max_len), budget))
                self.next_sid += 1
            out.append(group)
            self.next_gid += 1
        return out


__all__ = ["SimCluster", "SimRequester", "SimSource"]
