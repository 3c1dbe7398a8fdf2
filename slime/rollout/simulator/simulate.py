"""`simulate(config, cost, lengths) -> SimResult`: run a rollout mode for some steps in simulation.

The rollout is the real one, driven by drive.py. The result holds per-step records and aggregates after
`warmup_steps`: rollout and end-to-end tokens/s, goodput, engine idle, off-policy ratio, staleness histogram."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from slime.rollout.rollout import RolloutConfig
from slime.rollout.simulator.clock import run_virtual
from slime.rollout.simulator.cluster import SimCluster, SimSource
from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.simulator.drive import NO_TIMEOUT_S, Judge, Recorder, drive_steps, drive_stream
from slime.rollout.simulator.engine import EventLoop, SimEngine
from slime.rollout.staleness import GUARD_RESTART_BUDGET, StalenessCap

MODES = ("chunked", "pool", "stream")  # --rollout-mode's names (stream: train_async.py)


@dataclass(frozen=True)
class SimConfig:
    mode: str = "chunked"
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 8
    over_sampling_batch_size: int | None = None  # None: rollout_batch_size (synchronous without partial)
    partial_rollout: bool = False
    pool_size: int = 64  # pool and stream modes: requests in flight (admission auto: at most)
    admission: str = "fixed"  # pool and stream modes: --admission
    concurrency_per_engine: int = 512  # chunked mode: --sglang-server-concurrency
    num_engines: int = 1
    max_response_len: int = 1024
    pass_rate: float = 1.0  # share of finished groups the dynamic filter keeps
    max_staleness: int | None = None
    staleness_policy: str = "restart"
    restart_budget: int | None = GUARD_RESTART_BUDGET  # the length guard's, as a run's default; None: guard off
    reuse_stale_kv: bool = False
    pause_mode: str = "in_place"  # stream: how a push reaches the requests in flight (--pause-mode; steps: idle)
    prefix_cache: bool = True
    steps: int = 10
    warmup_steps: int = 2
    train_time_s: float = 0.0  # per step (chunked/pool: the engines wait; async: the trainer's time)
    max_async_lag: int = 1
    seed: int = 0
    budgets_are_lengths: bool = False  # each sample's length is its budget (ignore_eos benchmarks)
    # chunked mode with partial_rollout: top up once fewer than a chunk's worth are in flight, as the real
    # rollout does; False: the APRIL paper's rollout (whole chunks only)
    top_ups: bool = True
    record_timeline: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"SimConfig.mode: {self.mode!r} is not one of {MODES}")
        if self.rollout_batch_size < 1 or self.n_samples_per_prompt < 1 or self.steps < 1:
            raise ValueError("SimConfig: rollout_batch_size, n_samples_per_prompt and steps must be >= 1")
        if not 0 < self.pass_rate <= 1:
            raise ValueError(f"SimConfig.pass_rate must be in (0, 1], got {self.pass_rate}")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError("SimConfig.over_sampling_batch_size must be >= 1")

    @property
    def chunk(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @property
    def label(self) -> str:
        if self.mode != "chunked":
            return self.mode
        if not self.partial_rollout and self.chunk == self.rollout_batch_size:
            return "sync"
        return f"april(os={self.chunk})"

    def rollout_config(self) -> RolloutConfig:
        """The run's rollout configured as this simulated one (no wall-clock limits on a simulated clock)."""
        cap = StalenessCap(self.max_staleness, self.staleness_policy, self.restart_budget)
        return RolloutConfig(self.mode, self.rollout_batch_size, self.n_samples_per_prompt, self.chunk,
                             self.partial_rollout, self.pool_size, self.admission, self.concurrency_per_engine, cap,
                             self.pause_mode, self.reuse_stale_kv, NO_TIMEOUT_S, NO_TIMEOUT_S, NO_TIMEOUT_S,
                             top_ups=self.top_ups)

    def replace(self, **kw) -> "SimConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_args(cls, args, over_sampling_batch_size: int | None = None, **kw) -> "SimConfig":
        """The simulated configuration of a run's flags (`over_sampling_batch_size` for `auto`)."""
        osb = over_sampling_batch_size
        if osb is None and isinstance(args.over_sampling_batch_size, int):  # auto: the caller gives the size
            osb = args.over_sampling_batch_size
        base = dict(mode=args.rollout_mode, rollout_batch_size=args.rollout_batch_size,
                    n_samples_per_prompt=args.n_samples_per_prompt, over_sampling_batch_size=osb,
                    partial_rollout=args.partial_rollout, pool_size=args.rollout_pool_size, admission=args.admission,
                    concurrency_per_engine=args.sglang_server_concurrency, num_engines=args.num_engines,
                    max_response_len=args.rollout_max_response_len, max_staleness=args.max_staleness,
                    staleness_policy=args.staleness_policy, reuse_stale_kv=args.reuse_stale_kv,
                    pause_mode=args.pause_mode, budgets_are_lengths=args.rollout_ignore_eos,
                    restart_budget=StalenessCap.from_args(args).restart_budget)
        base.update(kw)
        return cls(**base)


@dataclass
class SimResult:
    config: SimConfig
    cost_name: str
    lengths: str
    steps: list[dict] = field(default_factory=list)
    timeline: list | None = None  # (t, engine id, running sequences) at every change
    engine_stats: dict = field(default_factory=dict)  # summed over engines, whole run
    client_timeline: list | None = None  # (t, requests in flight)
    ledger: dict = field(default_factory=dict)  # the ledger's counts at the end (balanced: checked)

    def measured(self) -> list[dict]:
        w = min(self.config.warmup_steps, max(0, len(self.steps) - 1))
        return self.steps[w:]

    def measured_engine_stats(self) -> dict:
        """The engines' counters (`SimEngine.stats`, summed over engines) over the measured steps only."""
        return sum_counters(s.get("engine", {}) for s in self.measured())

    def summary(self) -> dict:
        st = self.measured()
        rollout = sum(s["rollout_s"] for s in st)
        wall = sum(s["wall_s"] for s in st)
        new = sum(s["new_tokens"] for s in st)
        wasted = sum(s["wasted_tokens"] for s in st)
        hist: Counter = Counter()
        for s in st:
            hist.update(s["lag_tokens"])
        trained = sum(hist.values())
        off = sum(c for lag, c in hist.items() if lag > 0)
        busy = sum(s["busy_s"] for s in st)
        engines = self.config.num_engines
        return {
            "mode": self.config.label, "steps": len(st),
            "tokens_per_s": new / rollout if rollout else 0.0,
            "e2e_tokens_per_s": new / wall if wall else 0.0,
            "goodput_tokens_per_s": (new - wasted) / wall if wall else 0.0,
            "engine_idle_fraction": max(0.0, 1.0 - busy / (engines * rollout)) if rollout else 0.0,
            "off_policy_token_ratio": off / trained if trained else 0.0,
            "staleness_hist": {int(k): int(v) for k, v in sorted(hist.items())},
            "step_s": rollout / len(st) if st else 0.0,
            "time_to_target_s": sum(s["time_to_target_s"] for s in st) / len(st) if st else 0.0,
            "requests_per_step": sum(s["requests"] for s in st) / len(st) if st else 0.0,
            "reprefill_tokens_per_step": sum(s["reprefill_tokens"] for s in st) / len(st) if st else 0.0,
            "new_tokens": new, "wasted_tokens": wasted, "rollout_s": rollout, "wall_s": wall,
            "trained_samples_per_s": sum(len(s["trained_lengths"]) for s in st) / rollout if rollout else 0.0,
            "longest_decile_share": _mean([s.get("length/longest_decile_share") for s in st]),
            "guard_masked": sum(s["staleness"]["guard_masked"] for s in st),
        }


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def sum_counters(counters) -> dict:
    """Counter dicts summed key by key (engines' stats, or steps' engine deltas)."""
    total: dict = {}
    for c in counters:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return total


def simulate(cfg: SimConfig, cost: EngineCostModel, lengths) -> SimResult:
    return run_virtual(_simulate(cfg, cost, lengths))


async def _simulate(cfg: SimConfig, cost: EngineCostModel, lengths) -> SimResult:
    events = EventLoop(asyncio.get_running_loop())
    timeline = [] if cfg.record_timeline else None
    engines = [SimEngine(i, cost, events, prefix_cache=cfg.prefix_cache, timeline=timeline,
                         version_keyed=not cfg.reuse_stale_kv) for i in range(cfg.num_engines)]
    cluster = SimCluster(events, engines)
    if cfg.record_timeline:
        cluster.timeline = []
    source = SimSource(lengths, cfg.n_samples_per_prompt, cfg.max_response_len, cfg.seed, cfg.budgets_are_lengths)
    recorder = Recorder(cluster)
    drive = drive_stream if cfg.mode == "stream" else drive_steps
    await drive(cfg, cluster, source, Judge(cfg.pass_rate, cfg.seed), recorder)
    return SimResult(cfg, cost.name, lengths.describe(), steps=recorder.steps, timeline=timeline,
                     engine_stats=sum_counters(e.stats for e in engines), client_timeline=cluster.timeline,
                     ledger=recorder.ledger)
