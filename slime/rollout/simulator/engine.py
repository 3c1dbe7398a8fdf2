"""Discrete-event model of engines serving requests (continuous batching), on the running (simulated) loop.

`SimEngine` acts at step boundaries only, as SGLang's scheduler does: take commands, admit (admission.py), step.
Between changes to the batch its step cost is linear in the step index, so many decode steps are jumped in closed
form: millions of tokens cost thousands of events. Tokens carry the engine's weight version."""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from typing import Callable

from slime.rollout.simulator.admission import Admission, SimRequest
from slime.rollout.simulator.cost_model import EngineCostModel


class EventLoop:
    """The engines' events at simulated times: `at(t, fn, *args)` runs `fn(t, *args)` at `t` on the asyncio loop
    (the running one unless given), equal times in the order they were scheduled."""

    def __init__(self, aloop: asyncio.AbstractEventLoop | None = None):
        self._aloop = aloop

    @property
    def aloop(self) -> asyncio.AbstractEventLoop:
        if self._aloop is None:
            self._aloop = asyncio.get_running_loop()
        return self._aloop

    def at(self, t: float, fn: Callable, *args) -> None:
        (self._aloop or self.aloop).call_at(t, fn, t, *args)

    @property
    def now(self) -> float:
        return self.aloop.time()


class SimEngine(Admission):
    def __init__(self, eid: int, cost: EngineCostModel, loop: EventLoop, prefix_cache: bool = True,
                 timeline: list | None = None, version_keyed: bool = True):
        self.eid, self.cost, self.loop = eid, cost, loop
        self.prefix_cache_on = prefix_cache
        self.version_keyed = version_keyed
        self.t = 0.0
        self.k = 0
        self.running: dict[int, SimRequest] = {}
        self.finish_heap: list[tuple[int, int]] = []
        self.width_heap: list[tuple[int, int]] = []
        self.tokens_now = 0  # cached tokens over running rows at step k
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []  # "mixed": rows whose input is still being prefilled
        self._chunks: list[tuple[SimRequest, int]] | None = None  # "mixed": the prefill chunks of the step under way
        self.inbox: list[tuple[str, object]] = []
        self.jump: tuple | None = None  # (t0, alpha, beta, m, token)
        self.token = 0
        self._wake_at: float | None = None
        self._more = False  # admission stopped at the prefill budget: admit again after one decode step
        self._http = 0.0  # HTTP work owed (parsing requests, writing replies): the scheduler waits for it
        self._http_free = 0.0  # when the HTTP side is done with what it has
        self.version = 0
        self.cache: dict[int, tuple[int, int | None]] = {}  # sample id -> (cached tokens, its key)
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "evict_s": 0.0, "decode_steps": 0, "decode_rows": 0,
                      "prefill_tokens": 0, "prefills": 0, "prefill_decode_steps": 0, "cache_hits": 0, "cache_hit_tokens": 0, "retractions": 0,
                      "update_s": 0.0, "http_s": 0.0}
        self.timeline = timeline
        self._scheduled_at: float | None = None

    # ---- inputs ----------------------------------------------------------------------
    def deliver(self, t: float, kind: str, payload) -> None:
        """An input reaches the engine at `t`: it is taken at the first step boundary at or after `t`. A request
        is first parsed by the engine's HTTP side, one at a time (and the scheduler waits meanwhile: one process)."""
        if kind == "request":
            parse = self.cost.engine_per_request_s / 2 + self.cost.engine_per_input_token_s * payload.n_input
            if parse > 0:
                done = max(t, self._http_free) + parse
                self._http_free = done
                self._http += parse
                self.loop.at(done, self._parsed, payload)
                return
        self.inbox.append((kind, payload))
        self.poke(t)

    def _parsed(self, t: float, req) -> None:
        self.inbox.append(("request", req))
        self.poke(t)

    def poke(self, t: float) -> None:
        """Make sure a boundary happens at the first step end at or after `t`."""
        if self.jump is None:
            if self._scheduled_at is None or self._scheduled_at > t:
                self._schedule(max(t, self.t))
            return
        t0, alpha, beta, m, _ = self.jump
        j = self._steps_within(alpha, beta, t - t0)
        new_m = max(1, min(m, j + 1))
        if new_m < m:
            self.jump = (t0, alpha, beta, new_m, self.jump[4])
            self._schedule(t0 + self._jump_time(alpha, beta, new_m))

    def _schedule(self, t: float) -> None:
        self.token += 1
        self._scheduled_at = t
        if self.jump is not None:
            self.jump = self.jump[:4] + (self.token,)
        self.loop.at(t, self._boundary, self.token)

    @staticmethod
    def _jump_time(alpha: float, beta: float, m: int) -> float:
        return m * alpha + beta * m * (m - 1) / 2.0

    def _steps_within(self, alpha: float, beta: float, dt: float) -> int:
        """Largest j with the time of j steps <= dt."""
        if dt <= 0:
            return 0
        if beta <= 0:
            j = int(dt / alpha)
        else:
            b = alpha - beta / 2.0
            j = int((-b + math.sqrt(b * b + 2.0 * beta * dt)) / beta)
        while j > 0 and self._jump_time(alpha, beta, j) > dt:
            j -= 1
        while self._jump_time(alpha, beta, j + 1) <= dt:
            j += 1
        return j

    def _boundary(self, t: float, token: int) -> None:
        if token != self.token:
            return  # superseded by an earlier boundary
        self._scheduled_at = None
        if self.jump is not None:
            t0, alpha, beta, m, _ = self.jump
            self.jump = None
            b = len(self.running)
            if self._chunks is not None:  # a step that also prefilled (counted as the engine counts it)
                self.stats["prefill_s"] += t - t0
                self.stats["prefills"] += 1
                self.stats["prefill_tokens"] += sum(n for _, n in self._chunks)
                self.stats["prefill_decode_steps"] += b > 0
            else:
                self.stats["decode_s"] += t - t0
            self.stats["decode_steps"] += m if b else 0  # steps that decoded rows, with or without prefill tokens
            self.stats["decode_rows"] += m * b
            self.k += m
            self.tokens_now += m * b
            done = []
            while self.finish_heap and self.finish_heap[0][0] <= self.k:
                _, seq = heapq.heappop(self.finish_heap)
                req = self.running.pop(seq, None)
                if req is not None:
                    done.append(req)
            for req in done:
                self.tokens_now -= req.n_input - (1 if req.gen0 == 0 else 0) + (self.k - req.k_join)
                self._emit(t, req, req.target + req.produced, True)
            if done:
                ev = self.cost.finish_s * len(done)
                self.stats["evict_s"] += ev
                t += ev
            if self._chunks is not None:
                self._prefilled(t)
        self.t = t
        t = self._take_inbox(t)
        t = self._retract_if_full(t)
        t = self._admit(t)
        self.t = t
        self._start_jump(t)

    def _prefilled(self, t: float) -> None:
        """"mixed": the step's prompt chunks are cached; a completed input's row decodes from the next step."""
        chunks, self._chunks = self._chunks, None
        for req, take in chunks:
            req.cached += take
            if req.cached < req.n_input:
                continue
            self.prefilling.remove(req)
            req.gen0 = 1
            if req.target - req.produced <= 1:
                self._emit(t, req, req.produced + 1, True)
            else:
                self._join(req, req.n_input, req.target - req.produced - 1)

    def _take_inbox(self, t: float) -> float:
        items, self.inbox = self.inbox, []
        for kind, payload in items:
            if kind == "request":
                payload.key = self.version if self.version_keyed else None
                self.waiting.append(payload)
            elif kind == "abort":
                t = self._abort_all(t)
            elif kind == "abort_request":
                self._abort_one(t, payload)
            elif kind == "update":  # weights reach the engine between two steps, paused in `mode`
                version, flush, cost_s, mode = payload
                for req in self.running.values():
                    req.splits.append((self._produced(req), self.version))
                if mode == "retract":
                    self._retract_all()
                self.version = version
                if flush:
                    self.cache.clear()
                self.stats["update_s"] += cost_s
                t += cost_s
            else:
                raise ValueError(f"SimEngine: unknown input {kind!r}")
        return t

    def _produced(self, req: SimRequest) -> int:
        return req.produced + req.gen0 + (self.k - req.k_join)

    def _abort_all(self, t: float) -> float:
        """Every request ends; taking running rows out costs `finish_s` each. Returns the time after that."""
        ev = self.cost.finish_s * len(self.running)
        self.stats["evict_s"] += ev
        t += ev
        for req in list(self.running.values()):
            n = self._produced(req)
            if self.prefix_cache_on:  # SGLang's radix cache keeps an aborted request's KV
                self.cache[req.sample.sid] = (req.sample.n_tokens + n - 1, req.key)
            self._emit(t, req, n, False)
        self.running.clear()
        self.finish_heap.clear()
        self.width_heap.clear()
        self.tokens_now = 0
        for req in self.prefilling:  # nothing sampled yet (its partial KV is not reused: a rare, small saving)
            self._emit(t, req, req.produced, False)
        self.prefilling.clear()
        while self.waiting:
            req = self.waiting.popleft()
            self._emit(t, req, req.produced, False)
        return t

    def _abort_one(self, t: float, req: SimRequest) -> None:
        """One request aborted by its rid (a stale one after an in-place update): it ends as at an abort-all."""
        if req.seq in self.running:
            n = self._produced(req)
            del self.running[req.seq]
            self.tokens_now -= req.n_input - (1 if req.gen0 == 0 else 0) + (self.k - req.k_join)
            if self.prefix_cache_on:
                self.cache[req.sample.sid] = (req.sample.n_tokens + n - 1, req.key)
            self._prune_heaps()
            self._emit(t, req, n, False)
        elif req in self.prefilling or req in self.waiting:  # nothing sampled since it was (re)admitted
            (self.prefilling if req in self.prefilling else self.waiting).remove(req)
            self._emit(t, req, req.produced, False)

    def _emit(self, t: float, req: SimRequest, produced: int, finished: bool) -> None:
        write = self.cost.engine_per_request_s / 2 + self.cost.engine_per_output_token_s * produced
        if write > 0:  # the HTTP side writes the reply, one at a time, while the scheduler waits
            t = max(t, self._http_free) + write
            self._http_free = t
            self._http += write
        segs, prev = [], 0
        for upto, version in req.splits:
            segs.append((version, upto - prev))
            prev = upto
        segs.append((self.version, produced - prev))
        self.loop.at(t + self.cost.request_latency_s / 2, req.on_done, req, segs, finished)

    def _mixed_step(self, t: float, b: int) -> None:
        """ "mixed": one step of the running rows' decode and the prefilling rows' next chunks."""
        c = self.cost
        room, chunks, tokens, pairs = c.max_prefill_tokens, [], 0, 0.0
        for req in sorted(self.prefilling, key=lambda r: r.n_input - r.cached):
            take = min(req.n_input - req.cached, c.chunk_tokens, room - tokens)
            if take <= 0:
                break
            chunks.append((req, take))
            tokens += take
            pairs += take * req.cached + take * (take + 1) / 2
        self._chunks = chunks
        # (separate forwards: the decode rows' forward is decode-only, so it may replay its CUDA graph)
        read = self._decode_read(b, graph=c.separate_prefill)
        alpha = c.mixed_step_s(b, self.tokens_now, *read, tokens, pairs, len(chunks))
        self.jump = (t, alpha, 0.0, 1, 0)
        self._schedule(t + alpha)

    def _longest(self) -> int:
        while self.width_heap and self.width_heap[0][1] not in self.running:
            heapq.heappop(self.width_heap)
        return -self.width_heap[0][0] + self.k if self.width_heap else 0

    def _decode_read(self, b: int, graph: bool = True) -> tuple[int, int]:
        """(key positions gathered, buckets beyond the first) of the running rows' next decode step (`graph`: a
        decode-only forward, which may replay a CUDA graph; a mixed forward with prefill tokens never does)."""
        if not b:
            return 0, 0
        if self.cost.paged_block_size > 0:  # the paged engine's buckets, from every row's position
            return self.cost.decode_read([r.ctx0 + self.k - r.k_join for r in self.running.values()], graph)
        return b * self._longest(), 0  # cost.decode_read's padded case, from the heap (no pass over the rows)

    def _start_jump(self, t: float) -> None:
        if self._http:
            t += self._http
            self.stats["http_s"] += self._http
            self._http = 0.0
        b = len(self.running)
        if self.timeline is not None:
            self.timeline.append((t, self.eid, b))
        if self.prefilling:
            self._mixed_step(t, b)
            return
        if b == 0:
            if self.waiting:
                if not self._more:
                    raise RuntimeError(f"SimEngine {self.eid}: requests wait with an empty batch "
                                       "(one larger than the KV cache?)")
                self._schedule(t)  # every admitted row finished at its prefill: admit the next ones
            return
        c = self.cost
        m = 1 if self._more else self.finish_heap[0][0] - self.k
        if c.kv_admission == "optimistic":
            room = (c.kv_capacity_tokens - self.tokens_now - b) // b
            m = min(m, max(1, room))
        m = max(1, m)
        alpha, beta = c.decode_jump(b, self.tokens_now, *self._decode_read(b))  # a step's cost and its growth
        self.jump = (t, alpha, beta, m, 0)
        self._schedule(t + self._jump_time(alpha, beta, m))

    def token_usage(self) -> float:
        """The KV cache's used share, as the engines' load reports count it: positions holding KV now."""
        used = self.tokens_now + sum(r.cached for r in self.prefilling)
        return min(1.0, used / max(1, self.cost.kv_capacity_tokens))

    def busy_s(self) -> float:
        st = self.stats
        return st["prefill_s"] + st["decode_s"] + st["evict_s"] + st["update_s"] + st["http_s"]
