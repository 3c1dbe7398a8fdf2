"""Continuous-batching scheduler: one thread owns the model and the decode batch.

Everything that touches the model (prefill, decode, weight loads, aborts,
retractions) runs on that thread, between decode steps; the HTTP side talks to
it with `submit(fn)` (a callable run at the next step boundary, returning a
concurrent Future) and `add(request)`. Requests report back through their
`notify` callback (called on the scheduler thread).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from slime.backends.hf_engine.batch import DecodeBatch
from slime.backends.hf_engine.logprobs import LogprobRecord, fill_prompt_logprobs, record_output_logprobs
from slime.backends.hf_engine.prefix_cache import PrefixCache
from slime.backends.hf_engine.sampling import SamplingParams, sample_batch

logger = logging.getLogger(__name__)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    notify: Callable[["Request", bool], None] | None = None  # (request, finished)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    generator: torch.Generator | None = None
    created: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    enqueued: float = 0.0
    logprobs_extra: LogprobRecord | None = None  # prompt / top-k / chosen-id log-probs, when asked for
    # (first output index, weight version) each time the version that samples this request's tokens changes
    version_spans: list[tuple[int, str]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


PAD_SLACK_TOKENS = 1024  # up to this many padded positions, one masked prefill beats several forwards


def prefill_chunks(lengths: list[int]) -> list[list[int]]:
    """Split rows (indices into `lengths`) into batched prefills, shortest first: rows of one length
    share a prefill (no padding, so no mask: the fast causal attention path); rows of different
    lengths share one only while its left-padded size (rows x longest row) stays within PAD_SLACK_TOKENS.

    Resumed partial rollouts make long rows of distinct lengths common: padding a 300-token row with 39
    six-token prompts costs ~25x the long row alone, and a masked prefill of long rows runs attention
    through the slower masked path (1.5-2.7x at 1-3k tokens here)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = lengths[i]
        if cur and n != lengths[cur[0]] and (len(cur) + 1) * n > PAD_SLACK_TOKENS:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


@dataclass
class SchedulerStats:
    """Cumulative counters of where the scheduler thread's time goes (seconds) and how full its batches are."""

    prefill_s: float = 0.0  # batched prefills, sampling their first tokens, joining the decode batch
    decode_s: float = 0.0  # decode forwards + sampling
    decode_cpu_s: float = 0.0  # the same in the scheduler thread's CPU time (what a shared machine does not inflate)
    prefill_cpu_s: float = 0.0
    evict_s: float = 0.0  # removing finished or aborted rows from the batch
    idle_s: float = 0.0  # nothing to run (or paused)
    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode steps of the batch size
    decode_ctx_tokens: int = 0  # sum over decode steps of the rows' cached tokens (what paged attention reads)
    decode_padded: int = 0  # sum over decode steps of rows x the batch's attention window (what it reads here)
    prefills: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    prefill_positions: int = 0  # rows x longest row, i.e. with left padding
    cache_hits: int = 0  # requests that resumed an aborted request's KV (no prefill)
    cache_hit_tokens: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": 200, "err_type": None}


class Scheduler:
    def __init__(self, model, tokenizer, *, max_running: int, max_total_tokens: int, max_prefill_tokens: int, seed: int | None,
                 admit_wait_s: float = 0.02, prefix_cache_tokens: int | None = None, weight_version: str = "0"):
        self.model = model
        # the version of the weights in `model`: changed only on this thread, between steps, so every sampled
        # token is stamped with the version that produced it
        self.weight_version = weight_version
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        # While a batch is decoding, a few late arrivals wait up to admit_wait_s so they are prefilled and
        # joined together (each join costs a prefill forward).
        self.admit_wait_s = admit_wait_s
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.batch = DecodeBatch(model)
        # aborted requests' KV, for the requests that resume them (None: as many positions as max_total_tokens)
        self.prefix_cache = PrefixCache(max_total_tokens if prefix_cache_tokens is None else prefix_cache_tokens)
        self.running: list[Request] = []
        self._admitting: list[Request] = []
        self.waiting: collections.deque[Request] = collections.deque()
        self.paused = False
        self.default_generator = torch.Generator()
        self.default_generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.num_steps = 0
        self.stats = SchedulerStats()
        self._thread = threading.Thread(target=self._loop, name="hf-engine-scheduler", daemon=True)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids = set()
        for src in (getattr(model, "generation_config", None), model.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if tokenizer.eos_token_id is not None:
            ids.add(int(tokenizer.eos_token_id))
        return ids

    # ---- API for other threads -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.submit(self._abort_everything, "server shutting down")
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, fn: Callable, *args) -> Future:
        fut: Future = Future()
        self._inbox.put((fn, args, fut))
        self._wake.set()
        return fut

    def add(self, req: Request) -> Future:
        return self.submit(self._add, req)

    def cpu_times(self) -> dict:
        """CPU seconds so far of this process and of the scheduler thread (the rest is the HTTP side's)."""
        out = {"process_cpu_s": time.process_time()}
        try:
            out["thread_cpu_s"] = time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):  # no per-thread clocks here (not Linux), or not started
            pass
        return out

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def token_usage(self) -> int:
        return sum(r.num_tokens for r in list(self.running))

    # ---- commands (run on the scheduler thread) --------------------------------------
    def _add(self, req: Request) -> None:
        if any(r.rid == req.rid for r in self.running) or any(r.rid == req.rid for r in self.waiting):
            raise ValueError(f"rid {req.rid!r} is already in flight")
        req.enqueued = time.monotonic()
        self.waiting.append(req)

    def abort(self, rid: str | None, message: str = "aborted by /abort_request") -> int:
        """Finish the request `rid` (or every request when rid is None) with an abort reason."""
        gone = [i for i, r in enumerate(self.running) if rid is None or r.rid == rid]
        for i in gone:
            r = self.running[i]
            if self.prefix_cache.enabled:  # every cached token but the pending one
                self.prefix_cache.put(r.input_ids + r.output_ids, self.batch.row_kv(i, r.num_tokens - 1))
            self._finish(r, abort_reason(message))
        if gone:
            t0 = time.perf_counter()
            self.running = [self.running[i] for i in self.batch.remove(gone)]
            self.stats.evict_s += time.perf_counter() - t0
        n = len(gone)
        still = collections.deque()
        for r in self.waiting:
            if rid is None or r.rid == rid:
                self._finish(r, abort_reason(message))
                n += 1
            else:
                still.append(r)
        self.waiting = still
        return n

    def _abort_everything(self, message: str) -> int:
        return self.abort(None, message)

    def retract(self) -> int:
        """Drop the KV cache of every running request and put it back first in the queue."""
        n = len(self.running)
        for r in reversed(self.running):
            self.waiting.appendleft(r)
        self.running = []
        self.batch.clear()
        return n

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    # ---- KV memory (SGLang's kv_cache tag; see memory.py) ------------------------------
    def kv_cache_bytes(self) -> int:
        return self.batch.kv_bytes() + self.prefix_cache.nbytes()

    def release_kv_cache(self) -> int:
        """Free the KV storage (an idle engine's buffers and the prefix cache); returns the bytes freed."""
        freed = self.kv_cache_bytes()
        self.prefix_cache.clear()
        self.batch.free_kv()
        return freed

    def resume_kv_cache(self) -> None:
        """Nothing to allocate ahead: the next join allocates the KV buffers it needs."""

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    # ---- the loop --------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, args, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            self._drain_inbox()
            if self._stop:
                self._abort_everything("server shutting down")
                return
            if self.paused or (not self.running and not self.waiting):
                t0 = time.perf_counter()
                self._wake.wait(0.05)
                self._wake.clear()
                self.stats.idle_s += time.perf_counter() - t0
                continue
            try:
                self._admit()
                self._decode()
            except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
                logger.exception("scheduler step failed")
                victims = self._admitting + self.running
                self.running, self._admitting = [], []
                self.batch.clear()
                for r in victims:
                    if not r.finished:
                        self._finish(r, abort_reason(f"engine error: {e}"))

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.max_running:
            return
        if self.running:
            free = self.max_running - len(self.running)
            enough = min(free, max(1, len(self.running) // 4))
            if len(self.waiting) < enough and time.monotonic() - self.waiting[0].enqueued < self.admit_wait_s:
                return
        budget = self.max_total_tokens - sum(len(r.input_ids) + r.params.max_new_tokens for r in self.running)
        group: list[Request] = []
        prefill_tokens = 0
        while self.waiting and len(self.running) + len(group) < self.max_running:
            r = self.waiting[0]
            need = len(r.input_ids) + r.params.max_new_tokens
            if need > budget and (self.running or group):
                break
            if group and prefill_tokens + r.num_tokens > self.max_prefill_tokens:
                break
            self.waiting.popleft()
            try:
                fill_prompt_logprobs(self.model, r)  # no-op unless it asked for prompt log-probs
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                logger.exception("prompt log-probs of %s failed", r.rid)
                self._finish(r, abort_reason(f"engine error: {e}"))
                continue
            if r.params.max_new_tokens == 0:  # scoring only: nothing to sample
                self._finish(r, {"type": "length", "length": 0})
                continue
            budget -= need
            kv = self.prefix_cache.take(r.input_ids) if not r.output_ids else None
            if kv is not None:  # resumes an aborted request: its KV joins as is, its last token pending
                r.cached_tokens = len(r.input_ids) - 1
                self.batch.join_kv(kv, r.cached_tokens, r.input_ids[-1])
                self.running.append(r)
                self.stats.cache_hits += 1
                self.stats.cache_hit_tokens += r.cached_tokens
                continue
            group.append(r)
            prefill_tokens += r.num_tokens
        if not group:
            return
        self._admitting = group
        for chunk in prefill_chunks([r.num_tokens for r in group]):
            self._prefill_join([group[i] for i in chunk])
        self._admitting = []

    def _prefill_join(self, group: list[Request]) -> None:
        """One batched (left-padded) prefill of `group`, its first tokens sampled, the unfinished rows joined."""
        t0, c0 = time.perf_counter(), time.thread_time()
        seqs = [r.input_ids + r.output_ids for r in group]
        logits, cache, valid = self.batch.prefill(seqs)
        tokens, lps = sample_batch(logits, [r.params for r in group], [r.generator for r in group], self.default_generator)
        record_output_logprobs(group, logits)  # no-op unless some request asked for top-k / chosen-id log-probs
        keep, next_pos, pending = [], [], []
        for i, r in enumerate(group):
            self._append(r, tokens[i], lps[i])
            if not r.finished:
                keep.append(i)
                next_pos.append(r.num_tokens - 1)
                pending.append(tokens[i])
        if keep:
            self.batch.join(cache, valid, keep, next_pos, pending)
            self.running.extend(group[i] for i in keep)
        st = self.stats
        st.prefill_s += time.perf_counter() - t0
        st.prefill_cpu_s += time.thread_time() - c0
        st.prefills += 1
        st.prefill_rows += len(seqs)
        st.prefill_tokens += sum(len(x) for x in seqs)
        st.prefill_positions += len(seqs) * max(len(x) for x in seqs)

    def _decode(self) -> None:
        if not self.running:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        rs = self.running
        ctx = sum(len(r.input_ids) + len(r.output_ids) for r in rs) - len(rs)  # cached: all but the pending token
        width = self.batch.width
        logits = self.batch.step()
        self.num_steps += 1
        tokens, lps = sample_batch(logits, [r.params for r in rs], [r.generator for r in rs], self.default_generator)
        record_output_logprobs(rs, logits)
        done = []
        for i, r in enumerate(rs):
            self._append(r, tokens[i], lps[i])
            if r.finished:
                done.append(i)
        self.batch.set_pending(tokens)
        t1, c1 = time.perf_counter(), time.thread_time()
        if done:
            self.running = [rs[i] for i in self.batch.remove(done)]
        st = self.stats
        st.decode_s += t1 - t0
        st.decode_cpu_s += c1 - c0
        st.evict_s += time.perf_counter() - t1
        st.decode_steps += 1
        st.decode_rows += len(rs)
        st.decode_ctx_tokens += ctx
        st.decode_padded += len(rs) * width

    def _append(self, r: Request, token: int, logprob: float) -> None:
        if not r.version_spans or r.version_spans[-1][1] != self.weight_version:
            r.version_spans.append((len(r.output_ids), self.weight_version))
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        reason = self._finish_reason(r, token)
        if reason is not None:
            self._finish(r, reason)
        elif r.stream and r.notify is not None:
            r.notify(r, False)

    def _finish_reason(self, r: Request, token: int) -> dict | None:
        """SGLang's order: the length limit, then stop tokens (EOS and stop_token_ids, both off with
        ignore_eos, as in SGLang), then stop strings anywhere in the output text (also inside a
        multi-character token; special tokens' text counts, as in SGLang's tail check), then stop regexes."""
        p = r.params
        if len(r.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(r.output_ids)}
        if not p.ignore_eos and (token in p.stop_token_ids or token in self.eos_ids):
            return {"type": "stop", "matched": token}
        if p.stop or p.stop_regex:
            full = self.tokenizer.decode(r.output_ids, skip_special_tokens=False)
            shown = self.tokenizer.decode(r.output_ids, skip_special_tokens=True) if p.skip_special_tokens else full
            for s in p.stop:
                if s in full or s in shown:
                    return {"type": "stop", "matched": s}
            for rx in p.stop_regex:
                if rx.search(full):
                    return {"type": "stop", "matched": rx.pattern}
        return None

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        if r.notify is not None:
            r.notify(r, True)
