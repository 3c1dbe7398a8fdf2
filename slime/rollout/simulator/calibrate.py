"""Calibrate an `EngineCostModel` on a live engine (any server speaking SGLang's /generate).

Probes are synchronised batches (R requests of N new tokens, `ignore_eos`). Engines that report scheduler
counters (the embedded engine) are fitted on them, non-negative least squares: decode and prefill terms, or one
packed step cost for a paged "mixed" engine, and the host terms (`host_fit.py`); others (SGLang) are timed from
outside with two lengths. The HTTP round trip, abort-to-idle, the engine's HTTP side and, with `args`, the
client's own CPU cost on the rollout's real request path are measured directly."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from typing import Sequence

import aiohttp

from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING
from slime.backends.sglang_utils import http_client
from slime.rollout.simulator.cost_model import DECODE_TERMS, PREFILL_TERMS, EngineCostModel, nnls_fit
from slime.rollout.simulator.host_fit import fit_host
from slime.rollout.simulator.probes import (Probe, abort_to_idle_s, closed_loop_tps, default_probes, generate_one, random_ids,
                                            run_probe, scheduler_stats, stats_delta)

STEP_TERMS = DECODE_TERMS + PREFILL_TERMS  # "mixed": the joint step fit's columns
CLIENT_TERMS = ("client_per_request_s", "client_per_input_token_s", "client_per_token_s")

EMBEDDED_BACKEND = "slime.hf_engine"

logger = logging.getLogger(__name__)


class Calibrator:
    """Probes one engine: each `measure()` adds a pass over every probe; `fit()` makes the cost model."""

    def __init__(self, url: str, vocab: int | Sequence[int], client_url: str | None = None, new_tokens: int = 64,
                 seed: int = 0, name: str | None = None, quick: bool = False, args=None,
                 client_pids: Sequence[int] = (), max_context: int | None = None):
        # vocab: the tokenizer's size (random ids in [3, vocab)) or token ids to draw prompts from
        self.url, self.vocab, self.client_url = url, vocab, client_url or url
        self.new_tokens, self.rng, self.name, self.quick = new_tokens, random.Random(seed), name, quick
        # the longest context the probes use: the engine's own (None), or the workload's
        self.max_context = max_context
        self.info: dict | None = None
        self.stats_ok = False
        self.probes: list[Probe] = []
        self.latency: list[float] = []
        self.bursts: list[dict] = []
        self.trickles: list[dict] = []
        self.abort: list[float] = []
        self.curve: dict[str, float] = {}
        # the rollout's client: parsed flags (None: a bare client) and the other processes whose CPU is the client's
        self.args, self.client_pids = args, tuple(client_pids)
        self.client_bursts: list[dict] = []
        self.driver_share: list[float] = []

    @property
    def context(self) -> int:
        """The context the probes are sized for: the engine's, capped at `max_context`."""
        context = int((self.info or {}).get("context_length") or 2048)
        return min(context, self.max_context) if self.max_context else context

    async def measure(self, session, curve_levels: tuple[int, ...] = (), deadline: float | None = None) -> bool:
        """One pass over every probe and measurement. `deadline` (time.monotonic()): nothing new starts after it
        (the probes first, which the fit needs most); returns whether the pass was complete."""
        if self.info is None:
            self.info = await http_client.get(session, self.url, "/get_server_info", timeout=30)
            self.stats_ok = await scheduler_stats(session, self.url) is not None
            self.probes = default_probes(self.max_running, self.context, self.new_tokens, self.quick)
            await generate_one(session, self.url, random_ids(self.rng, self.vocab, 4), 8)  # warm-up
        started = time.monotonic()

        def out_of_time(what: str) -> bool:
            if deadline is None or time.monotonic() < deadline:
                return False
            logger.warning("calibration pass stopped before %s: its time is up (%.1fs into the pass)", what,
                           time.monotonic() - started)
            return True

        for i, p in enumerate(self.probes):
            if out_of_time(f"probe {i + 1} of {len(self.probes)}"):
                return False
            await run_probe(session, self.url, p, self.vocab, self.rng, self.stats_ok)
        if out_of_time("the round trips"):
            return False
        for _ in range(6):  # one request's round trip (one token: one tiny prefill)
            t0 = time.perf_counter()
            await generate_one(session, self.client_url, random_ids(self.rng, self.vocab, 8), 1)
            self.latency.append(time.perf_counter() - t0)
        # bursts of requests sent at once: the engine's HTTP side and the client's serial work
        burst = min(32, self.max_running)
        context = self.context
        long_in = max(16, min(1024, context // 2))
        long_n = max(16, min(64 if self.quick else 256, context - 16))
        if out_of_time("the bursts"):
            return False
        for in_len, out_n in ((8, 1), (long_in, 1), (8, long_n)):
            self.bursts.append(await self._burst(session, burst, in_len, out_n))
        if self.stats_ok and not out_of_time("the trickle"):
            self.trickles.append(await self._trickle(session, min(32, self.max_running), long_n, max(8, long_in // 4)))
        if self.args is not None:
            if out_of_time("the rollout client's bursts"):
                return False
            self.driver_share.append(_cpu_share())
            for in_len, out_n in ((8, 1), (long_in, 1), (8, long_n), (8, 1), (long_in, 1), (8, long_n)):
                self.client_bursts.append(await self._rollout_burst(session, burst, in_len, out_n))
        if out_of_time("the abort"):
            return False
        prompts = [random_ids(self.rng, self.vocab, 16) for _ in range(64)]
        self.abort.append(await abort_to_idle_s(session, self.url, prompts, min(16, self.max_running),
                                                max(64, min(900, context - 32))))
        for c in curve_levels:
            tps = await closed_loop_tps(session, self.url, prompts, c, 64, 2)
            self.curve[str(c)] = round(max(self.curve.get(str(c), 0.0), tps), 1)
        return True

    async def _burst(self, session, n: int, in_len: int, new_tokens: int) -> dict:
        """`n` requests sent at once: wall seconds, the engine's busy seconds and its HTTP side's CPU seconds."""
        before = await scheduler_stats(session, self.url) if self.stats_ok else None
        t0 = time.perf_counter()
        await asyncio.gather(*(generate_one(session, self.client_url, random_ids(self.rng, self.vocab, in_len), new_tokens)
                               for _ in range(n)))
        out = {"n": n, "in": n * in_len, "out": n * new_tokens, "wall": time.perf_counter() - t0, "busy": 0.0, "http_cpu": None}
        if before is not None:
            after = await scheduler_stats(session, self.url)
            d = stats_delta(after, before)
            out["busy"] = sum(d.get(k, 0.0) for k in ("prefill_s", "decode_s", "evict_s"))
            if "process_cpu_s" in d and "thread_cpu_s" in d:
                out["http_cpu"] = max(0.0, d["process_cpu_s"] - d["thread_cpu_s"])
        return out

    async def _trickle(self, session, background: int, new_tokens: int, in_len: int, n: int = 48,
                       concurrency: int = 4) -> dict:
        """Requests trickling in while `background` rows decode: the engine's HTTP CPU and scheduler admin time."""
        before = await scheduler_stats(session, self.url)
        bg = [asyncio.create_task(generate_one(session, self.client_url, random_ids(self.rng, self.vocab, 8), new_tokens))
              for _ in range(background)]
        todo = list(range(n))

        async def worker() -> None:
            while todo:
                todo.pop()
                await generate_one(session, self.client_url, random_ids(self.rng, self.vocab, in_len), 2)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await asyncio.gather(*bg)
        after = await scheduler_stats(session, self.url)
        d = stats_delta(after, before)
        http = max(0.0, d["process_cpu_s"] - d["thread_cpu_s"]) if "thread_cpu_s" in d else None
        admin = d.get("admin_s", 0.0) / d["requests_in"] if d.get("requests_in") else None
        return {"n": n + background, "in": in_len * n + 8 * background, "out": 2 * n + new_tokens * background,
                "http_cpu": http, "admin_per_request": admin, "trickled": n}

    async def _rollout_burst(self, session, n: int, in_len: int, new_tokens: int) -> dict:
        """`n` samples at once through the rollout's request path: the client's CPU seconds."""
        from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
        from slime.utils.types import Sample

        args = self.args
        req = SampleRequester(args, session, self.client_url, sampling_params_from_args(args), 0, 0,
                              max_response_len=new_tokens)
        samples = []
        for i in range(n):
            ids = random_ids(self.rng, self.vocab, in_len)
            samples.append(Sample(index=i, group_index=i, tokens=ids, metadata={"max_response_len": new_tokens}))
        c0, p0 = time.process_time(), _pids_cpu(self.client_pids)
        await asyncio.gather(*(req.generate(s) for s in samples))
        cpu = time.process_time() - c0 + _pids_cpu(self.client_pids) - p0
        return {"n": n, "in": n * in_len, "out": sum(s.response_length for s in samples), "cpu": cpu}

    def _client_and_http(self, latency: float, share: float | None) -> dict:
        """The engine's HTTP costs (over its scheduler's CPU share) and the client's serial costs, from bursts."""
        out: dict = {}
        rows = [b for b in self.bursts if b["http_cpu"] is not None]
        http = {"engine_per_request_s": 0.0, "engine_per_input_token_s": 0.0, "engine_per_output_token_s": 0.0}
        if len(rows) >= 3 and share:
            fit, _ = nnls_fit([[b["n"], b["in"], b["out"]] for b in rows], [b["http_cpu"] for b in rows], tuple(http),
                              weights=[1.0 / max(1e-6, b["http_cpu"]) for b in rows])
            http = {k: v / share for k, v in fit.items()}
            trickles = [t for t in self.trickles if t["http_cpu"] is not None]
            if trickles:  # requests arriving one by one cost more per request than a burst's (see _trickle)
                extra = sorted((t["http_cpu"] / share - http["engine_per_request_s"] * t["n"]
                                - http["engine_per_input_token_s"] * t["in"] - http["engine_per_output_token_s"] * t["out"])
                               / t["trickled"] for t in trickles)
                http["engine_per_request_s"] += max(0.0, extra[(len(extra) - 1) // 2])
        # the scheduler thread's own work per request outside its steps (measured on trickling requests)
        admin = sorted(t["admin_per_request"] for t in self.trickles if t["admin_per_request"] is not None)
        if admin:
            http["engine_per_request_s"] += admin[(len(admin) - 1) // 2]
        out.update(http)

        def extra_s(b):  # the burst's time beyond the engine (scheduler and HTTP side) and one round trip
            h = http["engine_per_request_s"] * b["n"] + http["engine_per_input_token_s"] * b["in"] \
                + http["engine_per_output_token_s"] * b["out"]
            return max(0.0, b["wall"] - b["busy"] - h - latency)

        short = sorted(extra_s(b) / b["n"] for b in self.bursts if b["out"] == b["n"] and b["in"] == 8 * b["n"])
        per_req = short[(len(short) - 1) // 2] if short else 0.0
        longs = sorted(max(0.0, extra_s(b) - per_req * b["n"]) / max(1, b["out"] - b["n"])
                       for b in self.bursts if b["out"] > b["n"])
        out["client_per_request_s"] = per_req
        out["client_per_token_s"] = longs[(len(longs) - 1) // 2] if longs else 0.0
        if len(self.client_bursts) >= 3:  # the rollout's own client, measured in CPU time
            rows = self.client_bursts
            fit, _ = nnls_fit([[b["n"], b["in"], b["out"]] for b in rows], [b["cpu"] for b in rows], CLIENT_TERMS,
                              weights=[1.0 / max(1e-6, b["cpu"]) for b in rows])
            ds = sorted(self.driver_share)
            driver_share = max(0.05, min(1.0, ds[(len(ds) - 1) // 2])) if ds else 1.0
            out.update({k: v / driver_share for k, v in fit.items()})
            out["_driver_share"] = driver_share
        return out

    @property
    def max_running(self) -> int:
        return int((self.info or {}).get("max_running_requests") or 128)

    def fit(self, stat: str = "median", clock: str = "wall") -> EngineCostModel:
        """`clock` "cpu": fit the engine thread's CPU seconds instead of wall seconds."""
        if self.info is None:
            raise RuntimeError("Calibrator.fit: measure() first")
        pts = [(p, p.step(stat, clock)) for p in self.probes if p.step(stat, clock)]
        if not pts:
            raise RuntimeError(f"Calibrator.fit: no {clock} measurements (the engine reports no such counters)")
        mixed_rows = [r for p in self.probes for r in (p.mixed if clock == "wall" else p.cpu_mixed)]
        if self.stats_ok and len(mixed_rows) < 3 and sum(1 for p in self.probes if p.prefill) < 3:
            # an engine that counts prefill forwards, timed on fewer than three probes: prefill would be priced free
            raise RuntimeError(f"Calibrator.fit: prefill measured on {sum(1 for p in self.probes if p.prefill)} "
                               f"probe(s), the fit needs 3 (was the calibration pass cut short?)")
        mixed = len(mixed_rows) >= 3
        prefill, prefill_err = {}, None
        rows = [r for p in self.probes for r in (p.prefill if clock == "wall" else p.cpu_prefill)]
        if mixed:  # one step cost over decode-only and mixed steps
            fit_rows = [x + [0] * len(PREFILL_TERMS) for _, (_, x) in pts] + [x for _, x in mixed_rows]
            fit_t = [s for _, (s, _) in pts] + [s for s, _ in mixed_rows]
            both, decode_err = nnls_fit(fit_rows, fit_t, STEP_TERMS, weights=[1.0 / max(1e-9, s) for s in fit_t])
            decode = {k: both[k] for k in DECODE_TERMS}
            prefill = {k: both[k] for k in PREFILL_TERMS}
            prefill_err = decode_err
        else:
            decode, decode_err = nnls_fit([x for _, (_, x) in pts], [s for _, (s, _) in pts],
                                          DECODE_TERMS, weights=[1.0 / s for _, (s, _) in pts])
        if len(rows) >= 3 and not mixed:
            prefill, prefill_err = nnls_fit([[f, pos, sq] for _, f, pos, sq in rows], [s for s, *_ in rows],
                                            PREFILL_TERMS[:3], weights=[1.0 / s if s > 0 else 1.0 for s, *_ in rows])
        # the host's part (wall clock only: the CPU-time fit is the engine's work alone)
        host, host_err = fit_host([r for p in self.probes for r in p.host]) if clock == "wall" else ({}, None)
        one_prefill = prefill.get("prefill_base_s", 0.0) + 8 * prefill.get("prefill_per_token_s", 0.0)
        # a pass cut short by its deadline may lack these (logged there); they then count as free
        lat = sorted(self.latency) or [0.0]
        latency = max(0.0, lat[len(lat) // 2] - one_prefill)
        ab = sorted(self.abort) or [0.0]
        ev = sorted(e for p in self.probes for e in p.evict)
        cpu = [r for p in self.probes for r in p.cpu_runs]
        wall = [r for p in self.probes for r in p.runs]
        share = sum(c for c, _ in cpu) / sum(w for w, _ in wall) if cpu and wall else None
        client_http = self._client_and_http(latency, share if clock == "wall" else 1.0)
        driver_share = client_http.pop("_driver_share", None)
        info, embedded = self.info, self.info.get("backend") == EMBEDDED_BACKEND
        coef = [decode[k] for k in DECODE_TERMS]
        extra = {"probes": [{"rows": len(p.lengths), "lengths": sorted(set(p.lengths)), "new_tokens": p.n,
                             "step_ms": [round(1e3 * s / x[0], 4) for s, x in p.runs],
                             "fit_ms": round(1e3 * sum(c * v for c, v in zip(coef, st[1])) / st[1][0], 4)}
                            for p, st in pts],
                 # what each probe's prefill forwards cost as measured (a fit that misprices prefill shows here)
                 "prefill_probes": [{"rows": len(p.lengths) + len(p.late), "tokens": sum(p.lengths) + sum(p.late),
                                     "ms_per_forward": [round(1e3 * s / max(1, f), 3) for s, f, *_ in p.prefill]}
                                    for p in self.probes if p.prefill],
                 "stat": stat, "passes": max((len(p.runs) for p in self.probes), default=0),
                 "decode_fit_rel_rms": round(decode_err, 4),
                 "prefill_fit_rel_rms": None if prefill_err is None else round(prefill_err, 4),
                 "host_fit_rel_rms": None if host_err is None else round(host_err, 4),
                 "timed_from": "scheduler_stats" if self.stats_ok else "wall_clock", "curve_tok_s": dict(self.curve),
                 "engine_cpu_share": None if share is None else round(share, 4),
                 "client": "rollout request path, CPU time" if self.client_bursts else "bare client, wall clock",
                 "driver_cpu_share": None if driver_share is None else round(driver_share, 4)}
        return EngineCostModel(
            **decode, **prefill, **host, abort_s=ab[(len(ab) - 1) // 2], request_latency_s=latency,
            finish_s=ev[(len(ev) - 1) // 2] if ev else 0.0,
            **client_http,
            admit_wait_s=0.02 if embedded and not mixed else 0.0, max_running=self.max_running,
            kv_capacity_tokens=int(info.get("max_total_num_tokens") or 1 << 30),
            kv_admission="reserve" if embedded else "optimistic",
            prefill_mode="mixed" if mixed else "batched",
            max_prefill_tokens=int((info.get("max_prefill_tokens") if mixed else info.get("chunked_prefill_size")) or 8192),
            chunked_prefill_size=int(info.get("chunked_prefill_size") or -1) if mixed else -1,
            paged_block_size=int(info.get("page_size") or 0) if embedded and mixed else 0,
            # the engine's bucket rule as it runs it (its default differs on a GPU)
            bucket_min_saving=int(info.get("bucket_min_saving") or BUCKET_MIN_SAVING),
            # decode-only steps padded to CUDA graphs' shapes (on a GPU by default; "static" pads the same way)
            graph_max_rows=int(info.get("cuda_graph_max_bs") or 0)
            if embedded and mixed and info.get("cuda_graph_mode") in ("capture", "static") else 0,
            # the engine's step composition (SGLang's enable_mixed_chunk; engines from before it always mixed)
            separate_prefill=embedded and mixed and info.get("enable_mixed_chunk") is False,
            pad_slack_tokens=1024 if embedded and not mixed else 0, prefill_ragged=not embedded,
            name=self.name or f"calibrated {info.get('backend', 'sglang')}",
            source=f"calibrated on {self.url} ({'scheduler stats' if self.stats_ok else 'wall clock'}, "
                   f"{extra['passes']} passes, {stat}) at {time.strftime('%Y-%m-%d %H:%M:%S')}",
            extra=extra)


def _cpu_share(seconds: float = 0.03, tries: int = 3) -> float:
    """The share of a CPU this process gets now: CPU seconds over wall seconds of a short busy loop."""
    out = []
    for _ in range(tries):
        w0, c0 = time.perf_counter(), time.process_time()
        while time.perf_counter() - w0 < seconds:
            pass
        out.append((time.process_time() - c0) / (time.perf_counter() - w0))
    return sorted(out)[len(out) // 2]


def _pids_cpu(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) so far of other processes (Linux /proc); 0 for one that is gone."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


async def calibrate_async(url: str, vocab: int | Sequence[int], passes: int = 3, curve_levels: tuple[int, ...] = (), stat: str = "median",
                          client_url: str | None = None, name: str | None = None, seed: int = 0,
                          quick: bool = False, args=None, client_pids: Sequence[int] = ()) -> EngineCostModel:
    """Measure `url` (one engine) `passes` times and fit a cost model (`args`: also the rollout client's cost)."""
    cal = Calibrator(url, vocab, client_url=client_url, seed=seed, name=name, quick=quick, args=args,
                     client_pids=client_pids)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for i in range(passes):
            await cal.measure(session, curve_levels if i == 0 else ())
    return cal.fit(stat)
