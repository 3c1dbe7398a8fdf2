"""What joins and leaves a simulated engine's batch (engine.py's `SimEngine`): requests admitted from the
queue within the KV cache's reservations (SGLang's separate prefill forwards, or rows prefilled in chunks
with the embedded engine's "mixed" steps), resumed on their cached KV, or retracted when the cache overflows."""

from __future__ import annotations

import heapq
from typing import Callable


class SimRequest:
    __slots__ = ("seq", "sample", "n_input", "target", "max_new", "arrive_t", "k_join", "finish_k", "gen0",
                 "produced", "splits", "reserve", "on_done", "cached", "ctx0", "key")

    def __init__(self, seq, sample, arrive_t: float, on_done: Callable):
        self.seq, self.sample, self.arrive_t, self.on_done = seq, sample, arrive_t, on_done
        self.n_input = sample.n_tokens
        self.target = sample.final_len - sample.resp_len  # tokens it will produce unless aborted
        self.max_new = sample.budget - sample.resp_len  # what the engine is told (max_new_tokens)
        self.k_join = self.finish_k = self.gen0 = 0
        self.produced = 0  # tokens produced before a retraction (kept, re-prefilled)
        self.splits: list[tuple[int, int]] = []  # (tokens produced so far, version) at each weight update
        self.reserve = 0
        self.cached = 0  # "mixed" prefill: input tokens already in the KV cache
        self.key = None  # its prefix-cache namespace: the version it reached the engine at (version-keyed)
        self.ctx0 = 0  # its position at the step it joined the decoding rows (k_join)


class Admission:
    """SimEngine's admission (its state: `running`, `waiting`, `prefilling`, the heaps, `cache`, `stats`)."""

    def _retract_if_full(self, t: float) -> float:
        """SGLang-style: when the cache overflows, the newest rows requeue with their KV dropped (prefilled
        again)."""
        cap = self.cost.kv_capacity_tokens
        if self.cost.kv_admission != "optimistic":
            return t
        while len(self.running) > 1 and self.tokens_now + len(self.running) > cap:
            self._retract(max(self.running.values(), key=lambda r: (r.k_join, r.seq)))
        self._prune_heaps()
        return t

    def _retract(self, req: SimRequest) -> None:
        """A running row back to the head of the queue: its tokens kept, its KV dropped (prefilled again)."""
        n = self._produced(req)
        del self.running[req.seq]
        self.tokens_now -= req.n_input - (1 if req.gen0 == 0 else 0) + (self.k - req.k_join)
        req.produced = n
        req.n_input = req.sample.n_tokens + n
        self.waiting.appendleft(req)
        self.stats["retractions"] += 1

    def _retract_all(self) -> None:
        """`/pause_generation` retract: every running row retracted, every partly prefilled row's KV dropped."""
        for req in sorted(self.running.values(), key=lambda r: r.seq, reverse=True):
            self._retract(req)
        for req in self.prefilling:
            req.cached = 0
        self._prune_heaps()

    def _prune_heaps(self) -> None:
        self.finish_heap = [(fk, s) for fk, s in self.finish_heap if s in self.running]
        heapq.heapify(self.finish_heap)
        self.width_heap = [(w, s) for w, s in self.width_heap if s in self.running]
        heapq.heapify(self.width_heap)

    def _reserve(self, req: SimRequest) -> int:
        left = req.max_new - req.produced
        if self.cost.kv_admission == "reserve":
            return req.n_input + left
        return req.n_input + int(self.cost.optimistic_reserve_frac * min(left, 4096))

    def _admit(self, t: float) -> float:
        if self.cost.prefill_mode == "mixed":
            return self._admit_rows(t)
        c = self.cost
        self._more = False
        if not self.waiting or len(self.running) >= c.max_running:
            return t
        if self.running and c.admit_wait_s > 0:
            free = c.max_running - len(self.running)
            enough = min(free, max(1, len(self.running) // 4))
            oldest = self.waiting[0].arrive_t
            if len(self.waiting) < enough and t - oldest < c.admit_wait_s:
                wake = oldest + c.admit_wait_s
                if self._wake_at != wake:
                    self._wake_at = wake
                    self.loop.at(wake, lambda tt: self.poke(tt))
                return t
        if c.kv_admission == "reserve":
            used = sum(r.reserve for r in self.running.values())
        else:
            used = self.tokens_now + len(self.running)
        budget = c.kv_capacity_tokens - used
        group: list[SimRequest] = []
        hits: list[SimRequest] = []
        prefill_tokens = 0
        while self.waiting and len(self.running) + len(group) + len(hits) < c.max_running:
            req = self.waiting[0]
            need = self._reserve(req)
            if need > budget and (self.running or group or hits):
                break
            if group and prefill_tokens + req.n_input > c.max_prefill_tokens:
                self._more = True  # the rest is admitted before the next decode step
                break
            self.waiting.popleft()
            budget -= need
            req.reserve = need
            cached = self.cache.pop(req.sample.sid, None) if req.produced == 0 else None
            if cached is not None and cached[0] == req.n_input - 1 and cached[1] == req.key:
                hits.append(req)
                self.stats["cache_hits"] += 1
                self.stats["cache_hit_tokens"] += cached[0]
            else:
                group.append(req)
                prefill_tokens += req.n_input
        if group:
            dt = c.prefill_s([r.n_input for r in group])
            self.stats["prefill_s"] += dt
            self.stats["prefills"] += 1
            self.stats["prefill_tokens"] += prefill_tokens
            t += dt
        for req in group:  # prefilled: the first token is sampled by the prefill
            req.gen0 = 1
            if req.target - req.produced <= 1:
                self._emit(t, req, req.produced + 1, True)
                continue
            self._join(req, req.n_input, req.target - req.produced - 1)
        for req in hits:  # resumed on its cached KV: its last token is the pending one, no prefill
            req.gen0 = 0
            self._join(req, req.n_input - 1, req.target - req.produced)
        return t

    def _admit_rows(self, t: float) -> float:
        """ "mixed": waiting requests become rows while the token reservations allow (no prefill here, no
        admission wait); a request resuming on its cached KV decodes at once, any other is prefilled in steps."""
        c = self.cost
        rows = len(self.running) + len(self.prefilling)
        if not self.waiting or rows >= c.max_running:
            return t
        if c.kv_admission == "reserve":
            used = sum(r.reserve for r in self.running.values()) + sum(r.reserve for r in self.prefilling)
        else:
            used = self.tokens_now + len(self.running) + sum(r.cached for r in self.prefilling)
        budget = c.kv_capacity_tokens - used
        while self.waiting and rows < c.max_running:
            req = self.waiting[0]
            need = self._reserve(req)
            if need > budget and rows:
                break
            self.waiting.popleft()
            budget -= need
            req.reserve = need
            rows += 1
            cached = self.cache.pop(req.sample.sid, None) if req.produced == 0 else None
            if cached is not None and cached[0] == req.n_input - 1 and cached[1] == req.key:
                self.stats["cache_hits"] += 1
                self.stats["cache_hit_tokens"] += cached[0]
                req.gen0 = 0
                self._join(req, req.n_input - 1, req.target - req.produced)
            else:
                req.cached = 0
                self.prefilling.append(req)
        return t

    def _join(self, req: SimRequest, ctx0: int, steps_left: int) -> None:
        req.k_join = self.k
        req.ctx0 = ctx0
        req.finish_k = self.k + steps_left
        self.running[req.seq] = req
        heapq.heappush(self.finish_heap, (req.finish_k, req.seq))
        heapq.heappush(self.width_heap, (-(ctx0 - self.k), req.seq))
        self.tokens_now += ctx0
