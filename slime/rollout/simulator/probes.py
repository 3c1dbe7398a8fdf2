"""What the calibration sends to an engine: synchronised probe batches (`Probe`, `run_probe`, `default_probes`),
and the engine benchmark's `closed_loop_tps` and `abort_to_idle_s`."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Sequence

from slime.backends.sglang_utils import engine_api, http_client

logger = logging.getLogger(__name__)


def sampling_params(new_tokens: int) -> dict:
    return {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}


async def generate_one(session, url: str, ids: list[int], new_tokens: int, rid: str | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": sampling_params(new_tokens), "return_logprob": True}  # as the rollout asks
    if rid:
        body["rid"] = rid
    return await http_client.generate(session, url, body, timeout=600)


async def closed_loop_tps(session, url: str, prompts: list[list[int]], in_flight: int, new_tokens: int, rounds: int) -> float:
    """Tokens/s with `in_flight` workers each sending `rounds` requests back to back."""
    total = 0

    async def worker(w: int) -> None:
        nonlocal total
        for r in range(rounds):
            out = await generate_one(session, url, prompts[(w * rounds + r) % len(prompts)], new_tokens)
            total += out["meta_info"]["completion_tokens"]

    await generate_one(session, url, prompts[0], 4)  # warm-up, not counted
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(in_flight)))
    return total / (time.perf_counter() - t0)


async def abort_to_idle_s(session, url: str, prompts: list[list[int]], n: int, new_tokens: int = 900) -> float:
    """Put `n` long requests in flight, abort all, time until every response is back and the engine is idle."""
    tasks = [asyncio.create_task(generate_one(session, url, prompts[i % len(prompts)], new_tokens, f"calib-abort-{i}-{time.time_ns()}"))
             for i in range(n)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if await requests_in_flight(session, url) >= n:
            break
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    await http_client.post(session, url, "/abort_request", {"abort_all": True}, timeout=30)
    outs = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    elapsed = time.perf_counter() - t0
    if not any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs):
        logger.info("%s: every probe request finished before the abort (short context); abort time is a lower bound", url)
    return elapsed


async def requests_in_flight(session, url: str) -> int:
    """Running + waiting requests of one engine over its DP ranks (`/v1/loads`, else `/get_load`)."""
    return await engine_api.busy(session, url, timeout=10)


async def scheduler_stats(session, url: str) -> dict | None:
    info = await http_client.get(session, url, "/get_server_info", timeout=30)
    states = info.get("internal_states") or [{}]
    st = states[0].get("scheduler_stats") if isinstance(states[0], dict) else None
    return dict(st) if isinstance(st, dict) and "decode_s" in st else None


def stats_delta(after: dict, before: dict) -> dict:
    """What the engine's cumulative counters added between two reads."""
    return {k: v - before.get(k, 0) for k, v in after.items()}


async def run_batch(session, url: str, rows: list[list[int]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    await asyncio.gather(*(generate_one(session, url, r, new_tokens) for r in rows))
    return time.perf_counter() - t0


class Probe:
    """A synchronised batch: rows of the given prompt lengths, N new tokens each."""

    def __init__(self, lengths: list[int], new_tokens: int, late: list[int] | None = None, delay_s: float = 0.0):
        self.lengths, self.n = lengths, new_tokens
        self.late, self.delay_s = late or [], delay_s  # rows sent `delay_s` after the others (prefilled while they decode)
        # "mixed" engines, per run: (seconds, [steps, decoded rows, keys, positions, steps, prefill tokens, pairs])
        self.mixed: list[tuple[float, list[float]]] = []
        self.cpu_mixed: list[tuple[float, list[float]]] = []
        # per run: (decode seconds, [steps, rows, cached tokens, padded positions, extra buckets] summed over steps);
        # cpu_runs: the same in the engine thread's CPU seconds
        self.runs: list[tuple[float, list[float]]] = []
        self.cpu_runs: list[tuple[float, list[float]]] = []
        self.prefill: list[tuple[float, int, int, float]] = []  # (seconds, forwards, positions, sum of len^2)
        self.evict: list[float] = []  # seconds per row taking its rows out of the batch when they finished, per run
        self.cpu_prefill: list[tuple[float, int, int, float]] = []
        # per run, engines that count them: (seconds issuing, seconds after the tokens were back, x) (host_fit.py)
        self.host: list[tuple[float, float, list[float]]] = []

    def step(self, stat, clock: str = "wall") -> tuple[float, list[float]] | None:
        """The run whose mean step time is the `stat` (min or median) of the runs."""
        runs = self.runs if clock == "wall" else self.cpu_runs
        if not runs:
            return None
        runs = sorted(runs, key=lambda r: r[0] / r[1][0])
        return runs[0] if stat == "min" else runs[(len(runs) - 1) // 2]

    def nominal(self, steps: float, rows: float) -> list[float]:
        """[steps, rows, cached tokens, padded positions, extra buckets] when the engine does not count the last
        three: the rows decode in lockstep, contexts growing by one token per step, one bucket."""
        r = len(self.lengths)
        grow = (self.n - 2) / 2.0
        per_row = (sum(self.lengths) + r * grow) / r
        return [steps, rows, rows * per_row, rows * (max(self.lengths) + grow), 0]


def random_ids(rng: random.Random, vocab: int | Sequence[int], n: int) -> list[int]:
    """`n` token ids: [1] then random ids in [3, vocab) (or drawn from the given ids)."""
    if isinstance(vocab, int):
        return [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]
    return [vocab[0]] + [rng.choice(vocab) for _ in range(n - 1)]


async def run_probe(session, url: str, probe: Probe, vocab, rng: random.Random, stats_ok: bool) -> None:
    rows = [random_ids(rng, vocab, n) for n in probe.lengths]
    late = [random_ids(rng, vocab, n) for n in probe.late]
    if stats_ok:
        before = await scheduler_stats(session, url)

        async def later():
            await asyncio.sleep(probe.delay_s)
            await run_batch(session, url, late, probe.n)

        await asyncio.gather(run_batch(session, url, rows, probe.n), *([later()] if late else []))
        after = await scheduler_stats(session, url)
        d = stats_delta(after, before)
        if "evict_s" in d:
            probe.evict.append(d["evict_s"] / (len(rows) + len(late)))
        if d.get("decode_steps", 0) > 0:
            if "decode_buckets" in d:  # the engine counts what each step read
                x = [d["decode_steps"], d["decode_rows"], d["decode_ctx_tokens"], d["decode_padded"],
                     d["decode_buckets"] - d["decode_steps"]]
            else:
                x = probe.nominal(d["decode_steps"], d["decode_rows"])
            tail = d.get("decode_tail_s", 0.0)
            probe.runs.append((d["decode_s"] - tail, x))
            if "decode_launch_s" in d and "decode_tail_s" in d:
                probe.host.append((d["decode_launch_s"], tail, x))
            if "decode_cpu_s" in d:
                probe.cpu_runs.append((d["decode_cpu_s"], x))
        if d.get("prefills", 0) > 0 and "prefill_key_pairs" in d:  # mixed steps, as the engine counted them
            x = [d["prefills"], d["prefill_decode_rows"], d["prefill_decode_ctx_tokens"], d["prefill_decode_padded"],
                 d.get("prefill_decode_buckets", d["prefill_decode_steps"]) - d["prefill_decode_steps"],
                 d["prefills"], d["prefill_tokens"], d["prefill_key_pairs"], d["prefill_rows"]]
            probe.mixed.append((d["prefill_s"] - d.get("prefill_tail_s", 0.0), x))
            if "prefill_cpu_s" in d:
                probe.cpu_mixed.append((d["prefill_cpu_s"], x))
        if d.get("prefills", 0) > 0:  # attention's token pairs: each row's own (long rows prefill alone)
            sq = sum(n * n for n in probe.lengths)
            pos = int(d.get("prefill_positions", sum(probe.lengths)))
            probe.prefill.append((d["prefill_s"], int(d["prefills"]), pos, sq))
            if "prefill_cpu_s" in d:
                probe.cpu_prefill.append((d["prefill_cpu_s"], int(d["prefills"]), pos, sq))
    else:  # outside timing: the same batch at N and 2N; the difference is N decode steps
        n1, n2 = probe.n, 2 * probe.n
        w1 = await run_batch(session, url, rows, n1)
        w2 = await run_batch(session, url, rows, n2)
        r, steps, mid = len(rows), n2 - n1, (n1 + n2 - 1) / 2.0  # the extra steps' contexts: L_i + n1 .. L_i + n2 - 1
        x = [steps, r * steps, steps * (sum(probe.lengths) + r * mid), steps * r * (max(probe.lengths) + mid), 0]
        probe.runs.append((max(1e-6, w2 - w1), x))


def default_probes(max_running: int, context: int, new_tokens: int = 64, quick: bool = False) -> list[Probe]:
    """Short and long contexts at several batch sizes, short rows with one long row (padded vs paged cost), and
    rows of many lengths (buckets); `quick`: five probes."""
    ctx = max(64, context - new_tokens - 8)
    big = max(1, min(64, max_running))
    levels = sorted({1, min(4, big), min(16, big), big})
    long1, long2 = max(16, ctx // 4), max(32, ctx // 2)
    probes = [Probe([8] * c, new_tokens) for c in levels]
    probes += [Probe([long2], new_tokens), Probe([long2] * min(4, big), new_tokens),
               Probe([long1] * min(8, big), new_tokens), Probe([long2] * min(8, big), new_tokens),
               Probe([long1] * min(32, big), new_tokens)]
    probes.append(Probe([long2] + [8] * (min(32, big) - 1), new_tokens))
    # rows of many lengths, as a rollout has them: a paged engine splits them into buckets (each with its mask)
    probes += [Probe(spread_lengths(8, long2, r), new_tokens) for r in sorted({min(16, big), big})]
    if quick:
        keep = {0, len(levels) - 1, len(levels), len(levels) + 3, len(probes) - 1}
        probes = [p for i, p in enumerate(probes) if i in keep]
    # rows decoding while long prompts arrive: an engine that mixes prefill into decode steps runs mixed steps
    probes.append(Probe([8] * min(32, big), new_tokens, late=[long2] * min(4, big), delay_s=0.02))
    probes.append(Probe(spread_lengths(8, long1, min(32, big)), new_tokens, late=spread_lengths(16, long2, min(6, big)), delay_s=0.02))
    return probes


def spread_lengths(lo: int, hi: int, n: int) -> list[int]:
    """`n` lengths spread geometrically from `lo` to `hi`."""
    if n == 1:
        return [hi]
    return [int(round(lo * (hi / lo) ** (i / (n - 1)))) for i in range(n)]
