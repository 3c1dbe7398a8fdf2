"""The rollout benchmark's workload and its modes (used by `rollout_throughput.py`).

- `workload_lengths`: the budgets' distribution, by `--workload`: `pareto`, the subtract_chain task's
  truncated Pareto (a heavy tail: max / median 21-43x), or `lognormal`, the APRIL paper's setting as
  `tools/simulate_rollout.py paper` assumes it (log-normal, sigma 0.8, median 0.37 x the cap: max / median
  ~2.7x, a prompt's samples correlated), scaled to the same cap;
- `BudgetSource`: deterministic fresh groups with budgets from such a distribution;
- `constant_load`: C requests in flight the whole time (the full-occupancy
  limit, and the concurrency probe);
- `bump_version`: a simulated weight update between steps;
- `ModeRunner`: one rollout mode (sync, APRIL, pool, ...) with its own data
  source, buffer and policy version, run in slices and measured per step;
- `LimitRunner`: the full-occupancy limit run the same way, in slices of one steady state.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time

import aiohttp
import requests

from slime.ray.buffer import PartialRolloutBuffer
from slime.rollout.rollout_metrics import OccupancySampler
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.sglang_rollout import engine_rollout
from slime.rollout.simulator.lengths import ParetoLengths, paper_lengths
from slime.rollout.simulator.probes import stats_delta
from slime.utils.ledger import TRAINED
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3
from slime.utils.types import Sample

logger = logging.getLogger("rollout_throughput")


def build_bench_model(opts, workdir: str, tok) -> tuple[str, TinyQwen3Spec]:
    """The benchmarks' tiny random Qwen3 (--hidden, --layers, --heads), long enough for --scale x --cap tokens:
    its directory and spec."""
    spec = TinyQwen3Spec(hidden_size=opts.hidden, num_hidden_layers=opts.layers, num_attention_heads=opts.heads,
                         num_key_value_heads=max(1, opts.heads // 2), intermediate_size=2 * opts.hidden,
                         max_position_embeddings=opts.scale * opts.cap + 64)
    model_dir = os.path.join(workdir, "model")
    build_tiny_qwen3(model_dir, tok, spec, seed=0)
    return model_dir, spec


WORKLOADS = ("pareto", "lognormal")
PROMPT_LEN = 6


def workload_lengths(name: str, scale: int, cap: int):
    """The budgets of `--workload name`, at most `scale` x `cap` tokens (a simulator length model)."""
    if name == "pareto":
        return ParetoLengths(1.0, scale, cap, prompt_len=PROMPT_LEN)
    if name == "lognormal":
        return paper_lengths(scale * cap, prompt_len=PROMPT_LEN)
    raise ValueError(f"--workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")


def workload_summary(name: str, lengths, seed: int, n: int) -> dict:
    """The budgets' shape, from 5,000 groups of `n`: what a figure from this workload names."""
    rng = random.Random(seed)
    lens = sorted(x for _ in range(5000) for x in lengths.sample_group(rng, n)[1])
    med = lens[len(lens) // 2]
    return {"name": name, "lengths": lengths.describe(), "median": med, "mean": round(sum(lens) / len(lens), 1),
            "p90": lens[int(0.9 * len(lens))], "max": lens[-1], "max_over_median": round(lens[-1] / med, 1)}


class BudgetSource:
    """Deterministic fresh groups: random 6-token prompts; a group's budgets (`metadata["max_response_len"]`) drawn
    together from `lengths`, so a log-normal's within-group correlation holds."""

    def __init__(self, lengths, seed: int, n: int, vocab: int):
        self.lengths, self.rng, self.n, self.vocab = lengths, random.Random(seed), n, vocab
        self.group_counter = self.sample_counter = 0

    def get_groups(self, num: int) -> list[list[Sample]]:
        out = []
        for _ in range(num):
            _, budgets = self.lengths.sample_group(self.rng, self.n)
            group = []
            for budget in budgets:
                s = Sample(index=self.sample_counter, group_index=self.group_counter,
                           tokens=[1] + [self.rng.randrange(3, self.vocab) for _ in range(PROMPT_LEN - 1)], label="00")
                s.metadata["max_response_len"] = budget
                group.append(s)
                self.sample_counter += 1
            out.append(group)
            self.group_counter += 1
        return out


async def constant_load(args, engines, session, concurrency: int, seconds: float, source,
                        running: list | None = None, carry: list | None = None, ramp: float | None = None) -> float:
    """Tokens/s with `concurrency` requests in flight the whole time (a fresh sample as each finishes).

    With `carry`, the samples still unfinished at the end are kept there and continued first next time, so
    successive calls add up to one long steady state: long-tail samples stay in flight until they finish,
    as the modes' must. Without it they would be dropped at every slice, the in-flight contexts would stay
    short, and decode steps cheaper than the workload really allows.

    Without `ramp`, tokens returned / time until the stop. With `ramp`, the steady state only: the engines'
    own count of generated tokens between `ramp` seconds after the start and the stop (neither the ramp
    up nor the abort and drain are the steady state's cost), so this is an upper bound."""
    req = SampleRequester(args, session, engines.router_url, sampling_params_from_args(args), 0, 0)
    deadline = time.monotonic() + seconds + (ramp or 0.0)
    stop = asyncio.Event()

    async def worker():
        while time.monotonic() < deadline:
            sample = carry.pop() if carry else source.get_groups(1)[0][0]
            if not await req.generate(sample, stop) and carry is not None:
                carry.append(sample)

    urls = await asyncio.to_thread(engines.worker_urls)
    occupancy = OccupancySampler(session, urls)
    t0 = time.monotonic()
    occupancy.start()
    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    if ramp:
        await asyncio.sleep(ramp)
        (n0, c0), t0 = await engine_counts(session, urls), time.monotonic()
        await asyncio.sleep(seconds)
        (n1, c1), t_stop = await engine_counts(session, urls), time.monotonic()
    else:
        await asyncio.sleep(seconds)
        t_stop = time.monotonic()
    stop.set()
    await engines.abort_all_until_idle(timeout=60, session=session)
    await asyncio.gather(*tasks)
    tps = (n1 - n0) / without_captures(t_stop - t0, c1 - c0) if ramp else req.new_tokens / (t_stop - t0)
    occ = await occupancy.stop()
    if running is not None:
        running.append(occ.get("rollout/engine_running_reqs_mean", float("nan")))
    return tps


async def engine_counts(session, urls: list[str]) -> tuple[int, float]:
    """Tokens the engines have generated so far and their seconds capturing CUDA graphs (their scheduler
    counters, summed)."""
    tokens, capture = 0, 0.0
    for url in urls:
        async with session.get(url + "/get_server_info", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            st = (await resp.json())["internal_states"][0]["scheduler_stats"]
        tokens += st["sampled_tokens"]
        capture += st.get("cuda_graph_capture_s", 0.0)
    return tokens, capture


def without_captures(seconds: float, capture_s: float) -> float:
    """Wall seconds less what the engine spent capturing CUDA graphs meanwhile. The embedded engine captures a
    decode shape the first time a step needs it (its loop stalls meanwhile); SGLang captures every shape at start-up,
    so a capture is no step's cost: a mode whose measured steps met new shapes (sync's small batches, when it runs
    first) would otherwise pay for the others (on an H200: 2.2 s of a 4.5 s sync measurement)."""
    if capture_s > seconds:
        raise ValueError(f"{capture_s:.3f}s of CUDA graph captures within {seconds:.3f}s: counters of another interval")
    return seconds - capture_s


def bump_version(engines, version: int, flush: bool) -> None:
    """A simulated weight update: the new version, and (as a real update does by default) a flushed cache, so
    resumed samples are re-prefilled; flush=False is --reuse-stale-kv (flush_cache=false on the update)."""
    for url in engines.worker_urls():
        requests.post(url + "/update_weight_version", json={"new_version": str(version), "abort_all_requests": False},
                      timeout=30).raise_for_status()
        if flush:
            requests.post(url + "/flush_cache", timeout=30).raise_for_status()


def engine_stats(engines) -> dict:
    """The embedded engines' cumulative scheduler counters, summed over workers."""
    total: dict = {}
    for url in engines.worker_urls():
        info = requests.get(url + "/get_server_info", timeout=30).json()
        for k, v in info["internal_states"][0].get("scheduler_stats", {}).items():
            total[k] = total.get(k, 0) + v
    return total


class CountingBuffer(PartialRolloutBuffer):
    """The real buffer, counting the tokens every resumed (parked, unfinished) sample must re-prefill."""

    def __init__(self, args):
        super().__init__(args)
        self.reprefill_tokens = 0
        self.resumed_samples = 0

    def take_parked(self, num):
        groups = super().take_parked(num)
        for g in groups:
            for s in g:
                if not s.status.is_finished:
                    self.reprefill_tokens += len(s.tokens)
                    self.resumed_samples += 1
        return groups


# step_s: the step's wall time less the engine's CUDA graph captures in it (capture_s, see without_captures)
STAT_KEYS = ("step_s", "to_target_s", "abort_to_idle_s", "drain_s", "outside_s", "gap_s", "capture_s", "requests",
             "resumed_samples", "reprefill_tokens", "new_tokens", "occupancy", "over_sampling")


class ModeRunner:
    """One rollout mode with its own data source, buffer and policy version, run in slices of >= min_seconds."""

    def __init__(self, name, args, engines, http, source: BudgetSource, planner=None):
        # each mode traces into its own run directory (rollout_trace.jsonl: lengths, occupancy, bookkeeping)
        args = args.replace(run_dir=os.path.join(args.run_dir, name))
        self.name, self.args, self.engines, self.http = name, args, engines, http
        self.warmup_steps = 0  # rollout steps run before measuring (see warm_up)
        self.warm_step_s: float | None = None  # the warm-up's mean step seconds
        self.source = source
        self.buffer = CountingBuffer(args)
        # the mode's run-long rollout (planner: --over-sampling-batch-size auto's; --admission auto's controller)
        self.rollout = engine_rollout(args, self.buffer, source, engines, planner=planner)
        self.rollout.link.session = http
        self.step = 0
        self.tokens, self.wall, self.off, self.total_tok = 0.0, 0.0, 0.0, 0.0
        self.rounds: list[float] = []
        self.stats = {k: [] for k in STAT_KEYS}
        self.engine: dict = {}  # the engine's counters over the measured steps
        self.engine_total: dict = {}  # and over every step, the warm-up's too

    async def run_for(self, min_seconds: float, min_steps: int, after_step=None, deadline: float | None = None) -> float:
        """Steps until this slice took >= min_seconds of rollout time (and >= min_steps); returns its
        rollout time. `after_step(seconds)` is awaited after each step, outside the step's time. `deadline`
        (time.monotonic()): no step starts after it, once one step ran."""
        tokens, wall, steps = 0.0, 0.0, 0
        prev_end = None
        while (wall < min_seconds or steps < min_steps) and not (steps and deadline is not None
                                                                  and time.monotonic() >= deadline):
            t_bump = time.monotonic()
            bump_version(self.engines, self.step, self.rollout.flush_cache)  # simulated weight update: not rollout time
            rp0, rs0 = self.buffer.reprefill_tokens, self.buffer.resumed_samples
            e0 = engine_stats(self.engines)
            t0 = time.monotonic()
            self.rollout.version = self.step
            out = await self.rollout.step(self.step)
            wall_dt = time.monotonic() - t0
            delta = stats_delta(engine_stats(self.engines), e0)
            for k, v in delta.items():  # this step's engine time only
                self.engine[k] = self.engine.get(k, 0) + v
                self.engine_total[k] = self.engine_total.get(k, 0) + v  # warm-up included
            capture = delta.get("cuda_graph_capture_s", 0.0)
            dt = without_captures(wall_dt, capture)
            m = out.metrics
            self.buffer.mark([g[0].group_index for g in out.groups], TRAINED)
            tokens += m["rollout/new_tokens"]
            wall += dt
            steps += 1
            self.off += m["rollout/off_policy_tokens"]
            self.total_tok += m["rollout/trained_tokens"]
            st = self.stats
            st["step_s"].append(dt)
            st["to_target_s"].append(m["rollout/time_to_target_s"])
            st["abort_to_idle_s"].append(m["rollout/abort_to_idle_s"])
            st["drain_s"].append(m["rollout/drain_s"])
            st["outside_s"].append(wall_dt - m["rollout/drain_s"] - m["rollout/time_to_target_s"])
            st["capture_s"].append(capture)
            st["gap_s"].append(0.0 if prev_end is None else t_bump - prev_end)
            st["requests"].append(m["rollout/requests"])
            st["resumed_samples"].append(self.buffer.resumed_samples - rs0)
            st["reprefill_tokens"].append(self.buffer.reprefill_tokens - rp0)
            st["new_tokens"].append(m["rollout/new_tokens"])
            st["occupancy"].append(m.get("rollout/engine_running_reqs_mean", float("nan")))
            st["over_sampling"].append(m.get("rollout/over_sampling_batch_size", float("nan")))
            if after_step is not None:
                await after_step(dt)
            prev_end = time.monotonic()
            logger.info("%s step %d: %.0f tok/s in %.3fs (graph captures %.3fs more; target %.3fs, drain %.3fs, "
                        "abort->idle %.3fs), %d groups, parked %d, in-flight peak %d, engine running mean %.1f, resumed "
                        "%d (%d tok), off-policy %.3f", self.name, self.step, m["rollout/new_tokens"] / dt,
                        dt, capture, m["rollout/time_to_target_s"], m["rollout/drain_s"], m["rollout/abort_to_idle_s"],
                        len(out.groups), m["rollout/groups_parked"], m["rollout/in_flight_peak"],
                        st["occupancy"][-1], st["resumed_samples"][-1], st["reprefill_tokens"][-1],
                        m["rollout/off_policy_token_ratio"])
            self.step += 1
        self.buffer.check_balanced()
        self.tokens += tokens
        self.wall += wall
        self.rounds.append(tokens / wall)
        return wall

    async def warm_up(self, engine_steps: int, seconds: float | None = None) -> tuple[int, int]:
        """Steps (not measured) until the engine ran `engine_steps` forward steps for this mode, or (`seconds`) no
        step starts after that long; returns (rollout steps, engine steps) it took."""
        done, t0 = 0, time.monotonic()
        ran = 0
        while ran < engine_steps and (seconds is None or time.monotonic() - t0 < seconds):
            await self.run_for(0.0, 1)
            done += 1
            ran = self.engine.get("decode_steps", 0) + self.engine.get("prefills", 0)
        steps = self.stats["step_s"]
        self.warm_step_s = sum(steps) / len(steps) if steps else None  # what a step took, for planning
        self.reset_measurements()
        self.warmup_steps = done
        return done, ran

    def reset_measurements(self) -> None:
        """Forget what was measured so far (after a warm-up); the buffer and its parked samples stay."""
        self.tokens, self.wall, self.off, self.total_tok = 0.0, 0.0, 0.0, 0.0
        self.rounds = []
        self.stats = {k: [] for k in STAT_KEYS}
        self.engine = {}

    def result(self) -> dict:
        mean = {k: (sum(v) / len(v) if v else 0.0) for k, v in self.stats.items()}
        return {"tok_s": self.tokens / self.wall, "wall_s": self.wall, "steps": self.step, "rounds": self.rounds,
                "off_policy": self.off / self.total_tok if self.total_tok else 0.0, "mean": mean,
                "engine": self.engine}


# a limit slice counts the engine's tokens from this long after its requests went in (the ramp up is not
# the steady state) until its stop
RAMP_S = 0.3


class LimitRunner:
    """The full-occupancy limit: C* requests in flight the whole time, as one steady state measured in
    slices (its unfinished samples continue, on their KV, in the next slice)."""

    def __init__(self, args, engines, http, concurrency: int, source):
        self.args, self.engines, self.http, self.concurrency, self.source = args, engines, http, concurrency, source
        self.carry: list = []
        self.slices: list[float] = []
        self.seconds: list[float] = []
        self.running: list[float] = []
        self.engine: dict = {}

    async def slice(self, seconds: float) -> float:
        e0 = engine_stats(self.engines)
        tps = await constant_load(self.args, self.engines, self.http, self.concurrency, seconds, self.source,
                                  self.running, self.carry, ramp=RAMP_S)
        for k, v in stats_delta(engine_stats(self.engines), e0).items():
            self.engine[k] = self.engine.get(k, 0) + v
        self.slices.append(tps)
        self.seconds.append(seconds)
        return tps

    async def warm_up(self, engine_steps: int, seconds: float | None = None) -> int:
        """Slices (not measured) until the engine ran `engine_steps` forward steps, or (`seconds`) for that long;
        returns the engine steps it ran."""
        t_end = None if seconds is None else time.monotonic() + seconds
        ran = 0
        while ran < engine_steps and (t_end is None or time.monotonic() < t_end - 0.2):
            await self.slice(4.0 if t_end is None else max(0.2, min(4.0, t_end - time.monotonic() - RAMP_S)))
            ran = self.engine.get("decode_steps", 0) + self.engine.get("prefills", 0)
        self.reset_measurements()
        return ran

    def reset_measurements(self) -> None:
        self.slices, self.seconds, self.running, self.engine = [], [], [], {}

    @property
    def tok_s(self) -> float:
        return sum(t * s for t, s in zip(self.slices, self.seconds)) / sum(self.seconds)
