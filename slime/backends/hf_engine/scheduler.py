"""Continuous-batching scheduler: one thread owns the model and the running batch.

Everything touching the model runs on that thread between steps; the HTTP side calls `submit(fn)` and
`add(request)`. Each step feeds every decoding row's last token plus prompt chunks (`--max-prefill-tokens` per step,
`--chunked-prefill-size` per row); `step_composition` "mixed" packs both into one forward, "separate" runs two so
every decode forward replays its CUDA graph.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from slime.backends.hf_engine.batch import PagedBatch
from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING
from slime.backends.hf_engine.logprobs import fill_prompt_logprobs, record_output_logprobs
from slime.backends.hf_engine.prefix_cache import CachedKV, PrefixCache
from slime.backends.hf_engine.request import Request, abort_reason, eos_ids, finish_reason
from slime.backends.hf_engine.sampling import prepare_sampling, sample_tokens, to_host
from slime.backends.hf_engine.shared_prompts import SharedPrompts
from slime.backends.hf_engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

STEP_COMPOSITIONS = ("mixed", "separate")


class Scheduler:
    def __init__(self, model, tokenizer, *, max_running: int, max_total_tokens: int, max_prefill_tokens: int,
                 seed: int | None, chunked_prefill_size: int = -1, block_size: int = 32,
                 prefix_cache_tokens: int | None = None, attention_kernel: str = "sdpa", weight_version: str = "0",
                 bucket_min_saving: int = BUCKET_MIN_SAVING, cuda_graph: str = "off", cuda_graph_max_bs: int = 128,
                 step_composition: str = "mixed"):
        if step_composition not in STEP_COMPOSITIONS:
            raise ValueError(f"step_composition must be one of {STEP_COMPOSITIONS}, got {step_composition!r}")
        self.step_composition = step_composition
        self.model = model
        # the version of the weights in `model`: changed only on this thread, between steps, so every sampled
        # token is stamped with the version that produced it
        self.weight_version = weight_version
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        # prefill tokens per step (all rows), and per row per step (-1: a row's whole prompt at once)
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else max_prefill_tokens
        self.eos_ids = eos_ids(model, tokenizer)
        self.batch = PagedBatch(model, block_size=block_size, max_tokens=max_total_tokens, max_rows=max_running,
                                kernel=attention_kernel, min_bucket_saving=bucket_min_saving,
                                decode_graphs=cuda_graph, graph_max_rows=cuda_graph_max_bs)
        self.vocab = int(model.get_output_embeddings().weight.shape[0])  # the logits' width
        # aborted requests' KV, for the requests that resume them (None: as many positions as max_total_tokens)
        self.prefix_cache = PrefixCache(max_total_tokens if prefix_cache_tokens is None else prefix_cache_tokens,
                                        block_size, release=self.batch.pool.free)
        self.batch.reclaim = self.prefix_cache.evict
        self.running: list[Request] = []  # rows in the batch: decoding, or still being prefilled
        self.waiting: collections.deque[Request] = collections.deque()
        self.paused = False
        self.default_generator = torch.Generator()
        self.default_generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.num_steps = 0
        self.stats = SchedulerStats()
        self.shared = SharedPrompts(self.batch, self.stats)
        self._thread = threading.Thread(target=self._loop, name="hf-engine-scheduler", daemon=True)

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
        self.stats.requests_in += 1

    def abort(self, rid: str | None, message: str = "Aborted") -> int:
        """Finish the request `rid` (or every request when rid is None) with an abort reason. A running
        request's KV goes to the prefix cache, for the request that resumes it."""
        t0 = time.perf_counter()
        keep, n = [], 0
        for r in self.running:
            if rid is None or r.rid == rid:
                self._leave(r, cache=True)
                self._finish(r, abort_reason(message))
                n += 1
            else:
                keep.append(r)
        self.running = keep
        self.stats.evict_s += time.perf_counter() - t0
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
        """Drop the KV of every running request and put it back first in the queue (re-prefilled later)."""
        n = len(self.running)
        for r in reversed(self.running):
            self.stats.retracted_tokens += self.batch.cached(r.row)
            self.batch.drop(r.row)
            r.row = r.kv_version = r.leader = None
            r.retractions += 1
            self.waiting.appendleft(r)
        self.stats.retractions += n
        self.running = []
        self.shared.clear()
        return n

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    # ---- KV memory (SGLang's kv_cache tag; see memory.py) ------------------------------
    def kv_cache_bytes(self) -> int:
        return self.batch.kv_bytes()  # one paged pool: the running rows' blocks and the prefix cache's

    def release_kv_cache(self) -> int:
        """Free the KV storage of an idle engine: the prefix cache's blocks go back, then the pool's tensors
        are freed (SGLang flushes its cache on release too); returns the bytes freed."""
        self.prefix_cache.clear()
        return self.batch.free_kv()

    def resume_kv_cache(self) -> None:
        """Nothing to allocate ahead: the pool allocates a layer's blocks on its first write."""

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
        torch.set_num_threads(torch.get_num_threads())  # this thread's OpenMP team, which oneDNN's ops read
        if self.batch.device.type == "cuda":
            torch.cuda.set_device(self.batch.device)  # per thread: this one launches the steps
        st = self.stats
        while True:
            t0, e0 = time.perf_counter(), st.evict_s
            self._drain_inbox()
            st.admin_s += time.perf_counter() - t0 - (st.evict_s - e0)  # an abort's evictions count as evictions
            if self._stop:
                self._abort_everything("server shutting down")
                return
            if self.paused or (not self.running and not self.waiting):
                t0 = time.perf_counter()
                self._wake.wait(0.05)
                self._wake.clear()
                st.idle_s += time.perf_counter() - t0
                continue
            try:
                t0 = time.perf_counter()
                self._admit()
                st.admin_s += time.perf_counter() - t0
                self._step()
            except Exception as e:  # noqa: BLE001 - fail the affected requests, keep serving
                logger.exception("scheduler step failed")
                victims, self.running = self.running, []
                self.batch.clear()
                self.shared.clear()
                for r in victims:
                    r.row = r.leader = None
                    if not r.finished:
                        self._finish(r, abort_reason(f"engine error: {e}", 500))

    def _admit(self) -> None:
        """Waiting requests become rows as long as the running ones' token reservations allow: a row
        resuming an aborted request starts on its cached KV, any other starts empty (prefilled in steps)."""
        if not self.waiting or len(self.running) >= self.max_running:
            return
        budget = self.max_total_tokens - sum(len(r.input_ids) + r.params.max_new_tokens for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            need = len(r.input_ids) + r.params.max_new_tokens
            if need > budget and self.running:
                break
            self.waiting.popleft()
            try:
                fill_prompt_logprobs(self.model, r)  # no-op unless it asked for prompt log-probs
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                logger.exception("prompt log-probs of %s failed", r.rid)
                self._finish(r, abort_reason(f"engine error: {e}", 500))
                continue
            if r.params.max_new_tokens == 0:  # scoring only: nothing to sample
                self._finish(r, {"type": "length", "length": 0})
                continue
            budget -= need
            kv = self.prefix_cache.take(r.extra_key, r.input_ids) if not r.output_ids else None
            if kv is not None:
                r.row = self.batch.add_row(kv.blocks, kv.cached)
                r.cached_tokens = kv.cached
                r.kv_version = kv.version
                self.stats.cache_hits += 1
                self.stats.cache_hit_tokens += kv.cached
                if kv.version != self.weight_version:
                    self.stats.cache_stale_hits += 1
                    self.stats.cache_stale_hit_tokens += kv.cached
            else:
                r.row = self.batch.add_row()
                r.kv_version = self.weight_version
                if self.prefix_cache.enabled:
                    self.shared.admit(r)
            self.running.append(r)

    def _plan(self) -> tuple[list, list[Request], int, int, int, int]:
        """This step's segments (decoding rows' last tokens, then prompt chunks, fewest tokens left first, within the
        prefill budgets), samplers, rows decoded, prefill tokens, decode keys and the chunks' (query, key) pairs."""
        segments, samplers, prefilling = [], [], []
        for r in self.running:
            if r.leader is not None and not self.shared.ready(r):
                continue  # its prompt's KV is still being prefilled by its leader
            left = r.num_tokens - self.batch.cached(r.row)
            if left == 1:
                segments.append((r.row, [r.output_ids[-1] if r.output_ids else r.input_ids[-1]], True))
                samplers.append(r)
            else:
                prefilling.append((left, r))
        decoded = len(segments)
        decode_ctx = sum(self.batch.cached(row) for row, _, _ in segments)  # keys they attend, but their own
        budget = self.max_prefill_tokens
        prefill_tokens = pairs = 0
        for left, r in sorted(prefilling, key=lambda x: x[0]):
            take = min(left, self.chunk, budget - prefill_tokens)
            if take <= 0:
                break
            start = self.batch.cached(r.row)
            segments.append((r.row, r.tokens(start, start + take), take == left))
            prefill_tokens += take
            pairs += take * start + take * (take + 1) // 2
            if take == left:
                samplers.append(r)
        return segments, samplers, decoded, prefill_tokens, decode_ctx, pairs

    def _step(self) -> None:
        segments, samplers, decoded, prefill_tokens, decode_ctx, pairs = self._plan()
        if not segments:
            return
        if self.step_composition == "separate" and decoded and prefill_tokens:
            self._forward(segments[:decoded], samplers[:decoded], decoded, 0, decode_ctx, 0)
            self._forward(segments[decoded:], samplers[decoded:], 0, prefill_tokens, 0, pairs)
        else:
            self._forward(segments, samplers, decoded, prefill_tokens, decode_ctx, pairs)

    def _forward(self, segments: list, samplers: list[Request], decoded: int, prefill_tokens: int, decode_ctx: int,
                 pairs: int) -> None:
        """One forward over `segments` (`decoded` decoding rows, then prefill chunks): sampled, counted."""
        t0, c0 = time.perf_counter(), time.thread_time()
        # the samplers' parameters and uniforms go to the device with the step's metadata, before the forward;
        # the step then waits for the device once, when its tokens come back
        sampling = prepare_sampling([r.params for r in samplers], [r.generator for r in samplers],
                                    self.default_generator, self.vocab, self.batch.device) if samplers else None
        logits = self.batch.forward(segments)
        t0 += self.batch.graphs.last_capture_s  # capturing a CUDA graph is not the step's cost
        self.num_steps += 1
        done: list[Request] = []
        t_issued = t_back = time.perf_counter()
        if samplers:
            tok_dev, lp_dev = sample_tokens(logits, sampling)
            t_issued = time.perf_counter()
            tokens, lps = to_host(tok_dev, lp_dev)
            t_back = time.perf_counter()
            record_output_logprobs(samplers, logits)  # no-op unless some request asked for top-k / chosen-id log-probs
            for i, r in enumerate(samplers):
                self._append(r, tokens[i], lps[i])
                if r.finished:
                    done.append(r)
        t1, c1 = time.perf_counter(), time.thread_time()
        if done:
            gone = {id(r) for r in done}
            for r in done:
                self._leave(r, cache=False)
            self.running = [r for r in self.running if id(r) not in gone]
        self.stats.evict_s += time.perf_counter() - t1
        self.stats.record_step(wall=t1 - t0, cpu=c1 - c0, launch=t_issued - t0, tail=t1 - t_back, decoded=decoded,
                               decode_ctx=decode_ctx, prefill_tokens=prefill_tokens, prefill_pairs=pairs,
                               prefill_rows=len(segments) - decoded, sampled=len(samplers),
                               block_size=self.batch.block_size,
                               buckets=[(bk.q, bk.b * bk.m) for bk in self.batch.last_plan.buckets])

    def _leave(self, r: Request, cache: bool) -> None:
        """Take `r`'s row out of the batch; with `cache` (an abort) its KV goes to the prefix cache."""
        if r.row is None:
            return
        self.shared.leave(r)
        if cache and self.prefix_cache.enabled and self.batch.cached(r.row) > 0:
            blocks, cached = self.batch.detach(r.row)
            self.prefix_cache.put(r.extra_key, r.input_ids + r.output_ids, CachedKV(blocks, cached, r.kv_version))
        else:
            self.batch.drop(r.row)
        r.row = r.kv_version = None

    def _append(self, r: Request, token: int, logprob: float) -> None:
        if not r.version_spans or r.version_spans[-1][1] != self.weight_version:
            r.version_spans.append((len(r.output_ids), self.weight_version))
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        reason = finish_reason(r, token, self.eos_ids, self.tokenizer)
        if reason is not None:
            self._finish(r, reason)
        elif r.stream and r.notify is not None and len(r.output_ids) % (r.params.stream_interval or 1) == 0:
            r.notify(r, False)  # stream_interval: a chunk every that many tokens (a lagging reader then coalesces whole chunks)

    def _finish(self, r: Request, reason: dict) -> None:
        r.finish_reason = reason
        if r.notify is not None:
            r.notify(r, True)
