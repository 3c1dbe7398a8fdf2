"""`--over-sampling-batch-size auto`: each chunked step's size, chosen by simulating the run's own configuration
on the lengths (Kaplan-Meier) and filter rate of recent steps, in a background thread; best predicted goodput,
ties to the smallest; 2 x the batch until the first plan."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque

from slime.rollout.simulator import SimConfig, kaplan_meier, simulate
from slime.rollout.simulator.calibrate import calibrate_async
from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.simulator.gpu_presets import cost_model_from_spec

logger = logging.getLogger(__name__)

CANDIDATE_FACTORS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0)
MAX_FACTOR = 4.0
INITIAL_FACTOR = 2.0
WINDOW_STEPS = 8
# the buffer fills with long-tail samples over many steps: a short horizon flatters large sizes
SIM_STEPS, SIM_WARMUP = 24, 6
TIE = 0.01  # sizes this close to the best lose to the smallest of them (fewer parked, fewer off-policy tokens)
SWITCH = 0.03  # a new plan replaces the current size only if predicted this much better (no flip-flopping on noise)
FILTER_REASONS_EXCLUDED = ("stale_ready", "reward_unsettled")  # not the filter's doing


def step_observations(step) -> dict:
    """What one finished step showed: final and censored lengths, filter verdicts, prompt lengths."""
    finished, unfinished, prompts = [], [], []
    passed = rejected = 0
    for gid, st in step.groups.items():
        prompts.append(st.samples[0].prompt_length)
        if st.outcome is None:
            unfinished += [s.response_length for s in st.samples if not s.status.is_finished]
            continue
        finished += [s.response_length for s in st.samples]
        if st.outcome in ("accepted", "overflow"):
            passed += 1
        elif step.rejected.get(gid) not in FILTER_REASONS_EXCLUDED:
            rejected += 1
    return {"finished": finished, "unfinished": unfinished, "passed": passed, "rejected": rejected, "prompts": prompts}


class OverSamplingPlanner:
    """Sizes `base` (the run's simulated configuration) step by step; `cost` None: calibrate after step 0."""

    def __init__(self, base: SimConfig, cost_model: EngineCostModel | None = None):
        self.base = base
        self.batch = base.rollout_batch_size
        self.cost = cost_model
        self.choice = max(1, round(INITIAL_FACTOR * self.batch))
        self.finished: deque[list[int]] = deque(maxlen=WINDOW_STEPS)
        self.filter: deque[tuple[int, int]] = deque(maxlen=WINDOW_STEPS)
        self.prompts: deque[int] = deque(maxlen=4096)
        self.unfinished: list[int] = []
        self.steps_seen = 0
        self.plan_info: dict[str, float] = {}
        self.history: list[dict] = []  # every plan: step, predicted goodput per candidate, choice
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None

    @classmethod
    def from_args(cls, args, cost_model: EngineCostModel | None = None) -> "OverSamplingPlanner":
        if cost_model is None and args.rollout_cost_model is not None:
            cost_model = cost_model_from_spec(args.rollout_cost_model)
        return cls(SimConfig.from_args(args, over_sampling_batch_size=int(args.rollout_batch_size)), cost_model)

    def candidates(self) -> list[int]:
        return sorted({max(1, round(f * self.batch)) for f in CANDIDATE_FACTORS if f <= MAX_FACTOR})

    def size(self) -> int:
        self._take_plan()
        return self.choice

    def observe(self, obs: dict) -> None:
        self.finished.append(list(obs["finished"]))
        self.filter.append((obs["passed"], obs["rejected"]))
        self.prompts.extend(obs["prompts"])
        self.unfinished = list(obs["unfinished"])
        self.steps_seen += 1

    def pass_rate(self) -> float:
        passed = sum(p for p, _ in self.filter)
        rejected = sum(r for _, r in self.filter)
        return (passed + 1) / (passed + rejected + 1)  # one prior pass: no rejection seen -> 1.0, not less

    def due(self) -> bool:
        """After steps 1, 2, 4, 8, 16, then every 16: often while little is known, rarely once it is."""
        n = self.steps_seen
        return (n & (n - 1)) == 0 if n <= 16 else n % 16 == 0

    async def after_step(self, record, engines) -> None:
        """Record the step (its `StepRecord`); calibrate `engines` once (no cost model given); when due,
        start a plan in the background (the rollout goes on; the next step after it finishes uses it)."""
        self.observe(step_observations(record))
        if self.cost is None:
            urls = await asyncio.to_thread(engines.worker_urls)
            ids = sorted({t for st in list(record.groups.values())[:8] for t in st.samples[0].prompt_tokens}) or [1, 2, 3]
            logger.info("over-sampling auto: calibrating %s (once)", urls[0])
            self.cost = await calibrate_async(urls[0], ids, passes=1, quick=True,
                                              name="engines of this run (calibrated after step 0)")
            logger.info("over-sampling auto: %s", self.cost.describe())
        if self.due() and (self._pending is None or self._pending.done()):
            self._take_plan()
            args = self._plan_inputs()
            if args is not None:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="over-sampling-plan")
                self._pending = self._executor.submit(self._evaluate, *args)

    def _take_plan(self) -> None:
        """Apply a finished background plan (if any)."""
        if self._pending is not None and self._pending.done():
            pending, self._pending = self._pending, None
            self._apply(*pending.result())

    def wait(self, timeout: float | None = None) -> None:
        """Block until a background plan is done and apply it (tests; a run never waits)."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending], timeout=timeout)
            self._take_plan()

    def _plan_inputs(self):
        obs = [x for step in self.finished for x in step]
        if not obs and not self.unfinished:
            return None
        lengths = kaplan_meier(obs, self.unfinished, self.base.max_response_len, list(self.prompts) or [16])
        return lengths, self.pass_rate(), (len(obs), len(self.unfinished)), self.steps_seen

    def plan(self) -> dict:
        """Estimate the workload from the observations, simulate every candidate size; set the choice (now)."""
        inputs = self._plan_inputs()
        if inputs is None:
            return self.plan_info
        self._apply(*self._evaluate(*inputs))
        return self.plan_info

    def choose(self, lengths, pass_rate: float, seen: tuple[int, int] = (0, 0)) -> dict:
        """Simulate every candidate size on `lengths` (a length model) at `pass_rate`; set and return the choice."""
        self._apply(*self._evaluate(lengths, pass_rate, seen, self.steps_seen))
        return self.plan_info

    def _evaluate(self, lengths, pass_rate: float, seen: tuple[int, int], step: int):
        """Every candidate size simulated on the same draws (no state touched: runs in the background)."""
        t0 = time.monotonic()
        results = {}
        for c in self.candidates():
            cfg = self.base.replace(over_sampling_batch_size=c, steps=SIM_STEPS, warmup_steps=SIM_WARMUP,
                                    pass_rate=pass_rate, seed=0, record_timeline=False)
            results[c] = simulate(cfg, self.cost, lengths).summary()
        return results, pass_rate, seen, step, time.monotonic() - t0, lengths.describe()

    def _apply(self, results: dict, pass_rate: float, seen: tuple[int, int], step: int, plan_s: float, what: str) -> None:
        best = max(r["goodput_tokens_per_s"] for r in results.values())
        choice = min(c for c, r in results.items() if r["goodput_tokens_per_s"] >= (1 - TIE) * best)
        current = results.get(self.choice)
        if self.history and current is not None and results[choice]["goodput_tokens_per_s"] < (1 + SWITCH) * current["goodput_tokens_per_s"]:
            choice = self.choice  # not clearly better than what runs now
        self.choice = choice
        self.history.append({"after_step": step, "choice": choice, "pass_rate": round(pass_rate, 4),
                             "finished": seen[0], "unfinished": seen[1], "plan_s": round(plan_s, 3),
                             "goodput": {c: round(v["goodput_tokens_per_s"], 1) for c, v in results.items()}})
        r = results[choice]
        self.plan_info = {
            "rollout/over_sampling_predicted_tokens_per_s": r["tokens_per_s"],
            "rollout/over_sampling_predicted_goodput_tokens_per_s": r["goodput_tokens_per_s"],
            "rollout/over_sampling_predicted_off_policy_token_ratio": r["off_policy_token_ratio"],
            "rollout/over_sampling_pass_rate": pass_rate,
            "rollout/over_sampling_plan_s": plan_s,
        }
        logger.info("over-sampling auto: %d groups per chunk (predicted goodput %s; pass rate %.2f; %s)", choice,
                    ", ".join(f"{c}: {v['goodput_tokens_per_s']:.0f}" for c, v in results.items()), pass_rate, what)

    def metrics(self) -> dict[str, float]:
        return dict(self.plan_info)
