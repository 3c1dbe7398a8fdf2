"""`--admission`: how many requests a pool (`--rollout-mode pool`, and stream mode's segments) keeps in flight.

- `fixed`: `--rollout-pool-size`, always (what CoPRIS does);
- `auto`: the smaller of `cap`, AIMD over the engines' load reports (a retraction or high KV usage cuts it, a queue
  brings it down to what runs, full slots without a queue grow it by a group), and `StepClimb`, which judges probes
  of a neighbouring limit by each pool step's tokens/s and moves only on evidence beyond the steps' noise.

The run's `Rollout` builds the one `AdmissionControl` (it learns across steps); `LoadPoll` (one per step) feeds it
load reports. Measured against fixed pool sizes: benchmarks/admission_sweep.py."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MODES = ("auto", "fixed")


@dataclass(frozen=True)
class AimdRule:
    interval_s: float = 0.5  # between two load reports
    high_usage: float = 0.92  # KV token usage at which the engines count as full
    decrease: float = 0.75  # multiplicative decrease on congestion
    queue_slack: float = 0.1  # waiting requests tolerated, as a share of the running ones (at least one group)
    climb: float = 1.25  # a probe: the limit x or / this
    probe_steps: int = 4  # steps a probe runs, compared with as many steps at the limit just before it
    z: float = 2.0  # a probe must beat the limit by this many standard errors of the steps' own noise...
    tolerance: float = 0.03  # ... and by this share at least
    rest_steps: int = 6  # steps at the limit before the next probe; doubled whenever probes both ways find nothing
    max_rest_steps: int = 96


class StepClimb:
    """`--admission auto`'s step-level part: which limit, within what the loads allow, makes the steps fastest.

    A probe of a neighbouring limit wins only when its steps' tokens/s beat the steps before it by `z` standard
    errors and by `tolerance`; with nothing found either way it rests `rest_steps` (doubling)."""

    def __init__(self, start: int, rule: AimdRule):
        self.rule = rule
        self.home = start
        self.probe: int | None = None
        self.home_scores: deque[float] = deque(maxlen=rule.probe_steps)  # log tokens/s, last steps at home
        self.probe_scores: list[float] = []
        self.direction = 1
        self.failed = 0  # probe directions that found nothing since the last win
        self.rest = rule.probe_steps  # steps at home before the next probe
        self.rest_len = rule.rest_steps
        self.noise_sq, self.noise_n = 0.0, 0  # squared differences of successive steps at one limit
        self.probes = self.wins = 0

    @property
    def limit(self) -> int:
        return self.home if self.probe is None else self.probe

    def step(self, tokens_per_s: float, low: int, high: int) -> int:
        """A step ran at `limit` and made `tokens_per_s`; returns the limit for the next one, within [low, high]."""
        x = math.log(tokens_per_s)
        scores = self.home_scores if self.probe is None else self.probe_scores
        if scores:
            self.noise_sq += (x - scores[-1]) ** 2
            self.noise_n += 1
        scores.append(x)
        if self.probe is None:
            self.rest -= 1
            if self.rest <= 0 and len(self.home_scores) == self.home_scores.maxlen:
                self._start_probe(low, high)
        elif len(self.probe_scores) >= self.rule.probe_steps:
            self._judge_probe(low, high)
        return self.limit

    def _start_probe(self, low: int, high: int) -> None:
        for _ in range(2):
            step = self.rule.climb if self.direction > 0 else 1 / self.rule.climb
            target = max(low, min(high, round(self.home * step)))
            if target != self.home:
                self.probe, self.probe_scores = target, []
                self.probes += 1
                return
            self._found_nothing()  # no room that way

    def _judge_probe(self, low: int, high: int) -> None:
        home, probe = list(self.home_scores), self.probe_scores
        gain = sum(probe) / len(probe) - sum(home) / len(home)
        sigma = math.sqrt(self.noise_sq / (2 * self.noise_n)) if self.noise_n else 0.0  # one step's noise
        need = max(math.log1p(self.rule.tolerance), self.rule.z * sigma * math.sqrt(1 / len(home) + 1 / len(probe)))
        if gain > need:  # the probe is the new limit; go on that way
            self.home, self.probe = self.probe, None
            self.home_scores = deque(probe[-self.rule.probe_steps:], maxlen=self.rule.probe_steps)
            self.failed, self.rest_len, self.rest = 0, self.rule.rest_steps, 0
            self.wins += 1
            self._start_probe(low, high)
            return
        self.probe, self.probe_scores = None, []  # back to the limit, whose recent steps are measured again
        self.home_scores.clear()
        self._found_nothing()

    def _found_nothing(self) -> None:
        self.direction = -self.direction
        self.failed += 1
        if self.failed >= 2:  # both ways: rest, longer each time
            self.failed = 0
            self.rest = self.rest_len
            self.rest_len = min(self.rule.max_rest_steps, 2 * self.rest_len)
        else:
            self.rest = self.rule.probe_steps


class AdmissionControl:
    """The limit on requests in flight. `fixed`: `ceiling` always. `auto`: the loads set a cap (`observe(loads,
    in_flight)`), and within it the steps' own speed chooses (`after_step`, a `StepClimb`)."""

    def __init__(self, mode: str, ceiling: int, group: int, batch: int | None = None, rule: AimdRule = AimdRule()):
        if mode not in MODES:
            raise ValueError(f"--admission {mode!r} is not one of {MODES}")
        if ceiling < 1:
            raise ValueError(f"--rollout-pool-size must be >= 1, got {ceiling}")
        self.mode, self.ceiling, self.group, self.rule = mode, int(ceiling), max(1, int(group)), rule
        self.floor = min(self.ceiling, self.group)
        self.batch = batch  # requests of one batch (--rollout-batch-size x n): where auto starts, if the loads allow
        self.started = mode == "fixed"  # auto: the first load report sets the start
        self.observations = 0
        self.decreases = {"congestion": 0, "queue": 0}
        self.increases = 0
        self.cap = self.ceiling  # what the loads allow now
        self.queued = 0  # consecutive load reports with a queue beyond the slack
        self.climb: StepClimb | None = None  # auto, once started
        self.poll: LoadPoll | None = None  # the running step's load reports (auto)
        # before the first load report: one batch (auto's start), or the ceiling
        self.limit = min(self.ceiling, batch) if self.auto and batch else self.ceiling

    @property
    def auto(self) -> bool:
        return self.mode == "auto"

    def _start(self, loads: list[dict]) -> None:
        caps = [ld.get("max_running_requests") for ld in loads]
        if all(caps):
            self.cap = max(self.floor, min(self.ceiling, sum(int(c) for c in caps)))
        self.climb = StepClimb(min(self.cap, self.batch) if self.batch else self.cap, self.rule)
        self.limit = self.climb.limit
        self.started = True
        logger.info("admission auto: starting at %d requests in flight (ceiling %d)", self.limit, self.ceiling)

    def observe(self, loads: list[dict], in_flight: int) -> int:
        """One load report (SGLang's /v1/loads shape) and our requests in flight now; returns the new limit."""
        if not self.auto or not loads:
            return self.limit
        self.observations += 1
        running = sum(int(ld.get("num_running_reqs", 0) or 0) for ld in loads)
        waiting = sum(int(ld.get("num_waiting_reqs", 0) or 0) for ld in loads)
        usage = max(float(ld.get("token_usage", 0.0) or 0.0) for ld in loads)
        retracted = sum(int((ld.get("queues") or {}).get("retracted", 0) or 0) for ld in loads)
        if not self.started:
            self._start(loads)
        slack = max(self.group, int(self.rule.queue_slack * running))
        self.queued = self.queued + 1 if waiting > slack else 0
        before = self.limit
        if retracted > 0 or usage >= self.rule.high_usage:
            self.cap = max(self.floor, int(self.limit * self.rule.decrease))
            self.decreases["congestion"] += self.cap < before
        elif self.queued >= 2:  # a queue in two reports in a row: the engines run all they can (one while new
            self.cap = max(self.floor, min(self.limit, running + slack))  # rows are admitted is not a signal)
            self.decreases["queue"] += self.cap < before
        elif waiting <= slack and in_flight >= self.limit and self.cap < self.ceiling:
            self.cap = min(self.ceiling, self.cap + self.group)  # every slot in use, no queue: the loads allow more
            self.increases += 1
        self.limit = min(self.cap, self.climb.limit)
        if self.limit != before:
            logger.debug("admission auto: %d -> %d (running %d, waiting %d, KV usage %.2f, retracted %d, ours %d)",
                         before, self.limit, running, waiting, usage, retracted, in_flight)
        return self.limit

    def watch(self, io) -> None:
        """A step starts (`io`: its StepIO): auto polls its engines for load reports (`LoadPoll`) from now on, until
        `step_ended` (or the next step: one that failed never ended its poll)."""
        if self.poll is not None:
            self.poll.close()
        self.poll = LoadPoll(self, io) if self.auto else None

    def at_wake(self) -> int:
        """A wake of a pool step's loop: a report that came back is observed, the next asked for; the limit."""
        if self.poll is not None:
            self.poll.at_wake()
        return self.limit

    def step_ended(self, record) -> int:
        """A pool step that ran to its target judges its limit by its tokens/s; a stream segment keeps it."""
        poll, self.poll = self.poll, None
        if poll is None:  # (fixed, or no top-up ran)
            return self.limit
        poll.close()
        if record.target is None:
            return self.limit
        return self.after_step(poll.io.requester.new_tokens / max(1e-6, record.clock.now()))

    def after_step(self, tokens_per_s: float) -> int:
        """A step ran at `self.limit` at `tokens_per_s`: `StepClimb` picks the next limit within the cap."""
        if not self.auto or self.climb is None or tokens_per_s <= 0 or self.cap < self.climb.limit:
            return self.limit  # (while the loads' cap binds, the step says nothing about the climb's limit)
        before = self.limit
        self.limit = min(self.cap, self.climb.step(tokens_per_s, self.floor, self.cap))
        if self.limit != before:
            logger.debug("admission auto: step at %d made %.0f tokens/s; next step at %d", before, tokens_per_s,
                         self.limit)
        return self.limit

    def metrics(self) -> dict[str, float]:
        if not self.auto:
            return {}
        return {"rollout/admission_limit": float(self.limit), "rollout/admission_cap": float(self.cap),
                "rollout/admission_increases": float(self.increases),
                "rollout/admission_probes": float(self.climb.probes if self.climb else 0),
                "rollout/admission_probes_won": float(self.climb.wins if self.climb else 0),
                "rollout/admission_decreases_congestion": float(self.decreases["congestion"]),
                "rollout/admission_decreases_queue": float(self.decreases["queue"])}


class LoadPoll:
    """A step's load reports for `control`: `at_wake()` hands the latest to the controller and asks for the next
    after `interval_s` (in its own task); a failed report is skipped."""

    def __init__(self, control: AdmissionControl, io):
        self.control, self.io = control, io
        self.report: asyncio.Task | None = None
        self.asked = -math.inf
        self.warned = False

    async def _read(self) -> tuple[list[dict], int]:
        loads = await self.io.engines.loads(self.io.session)
        return loads, self.io.requester.in_flight

    def at_wake(self) -> None:
        if self.report is not None and self.report.done():
            report, self.report = self.report, None
            if report.exception() is None:
                self.control.observe(*report.result())
            elif not self.warned:
                self.warned = True
                logger.warning("admission auto: engine load report failed (%s: %s); holding %d in flight",
                               type(report.exception()).__name__, report.exception(), self.control.limit)
        now = asyncio.get_running_loop().time()
        if self.report is None and now - self.asked >= self.control.rule.interval_s:
            self.asked = now
            self.report = asyncio.ensure_future(self._read())

    def close(self) -> None:
        if self.report is not None and not self.report.done():
            self.report.cancel()
        elif self.report is not None and not self.report.cancelled():
            self.report.exception()  # (read: a report that failed after the step's last wake is not an error)


__all__ = ["AdmissionControl", "AimdRule", "LoadPoll", "MODES", "StepClimb"]
