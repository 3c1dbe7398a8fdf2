"""The rollout benchmark's host (used by `rollout_throughput.py`): the time budget (`Clock`, and the `Plan` of
warm-ups and runs that fits it), the box's speed probe (`box_speed`) and CPU pinning of the engines and the
driver (`pin_processes`)."""

from __future__ import annotations

import asyncio
import os
import sys
import time


class Clock:
    """--time-budget: seconds since the start (the engines' start included) and what is left."""

    def __init__(self, budget: float | None):
        self.t_start, self.budget = time.monotonic(), budget

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def left(self) -> float:
        return float("inf") if self.budget is None else self.budget - self.elapsed()

    def plan(self, opts, step_s: float, modes: list[str], warm_runs: int, sync_s: float | None = None) -> "Plan":
        return Plan(self, opts, step_s, modes, warm_runs, sync_s)


class Plan:
    """What each phase may take within --time-budget, from the engine's step time: one round is always run (and
    the first calibration pass when --simulate: it stops early if it must, see Calibrator.measure); the warm-up gets
    the rest, at most --warmup-seconds per partial mode and for the limit. Within a round each mode gets a share of
    what is left before the report's reserve (at least one step each)."""

    STEP_OVERHEAD_S = 0.6  # per mode step beyond it and its limit slice: the limit's ramp, the weight-version bump,
    # the engines' counters, the abort

    def __init__(self, clock: Clock, opts, step_s: float, modes: list[str], warm_runs: int,
                 sync_s: float | None = None):
        self.clock, self.opts, self.step_s = clock, opts, step_s
        # a sync step: as measured (`sync_s`), else its longest sample's decode steps at `step_s`, ramp and drain
        # (an overestimate where a prefill forward costs several decode steps: the probe's tok/s then counts them)
        self.sync_s = sync_s if sync_s else 1.2 * opts.scale * opts.cap * step_s + 0.5
        # before the warm-up: a partial mode's step guessed at a quarter of sync's (measured in the warm-up)
        self.mode_s = {m: self._mode_s(self.sync_s if m == "sync" else max(0.2, self.sync_s / 4)) for m in modes}
        self.report_s = opts.report_seconds
        self.calibration_s = opts.calibration_seconds if opts.simulate else 0.0
        self.warmup_s = opts.warmup_seconds
        self.warm_runs = warm_runs
        left = clock.left()
        if left != float("inf"):
            room = (left - self.round_s - (self.calibration_s or 0.0) - self.report_s) / warm_runs
            self.warmup_s = max(0.0, room if self.warmup_s is None else min(self.warmup_s, room))

    def _mode_s(self, step_s: float) -> float:
        """A mode's time in a round: steps until --min-seconds, each followed by a limit slice as long (clipped)."""
        o = self.opts
        steps = max(o.min_steps, -(-o.min_seconds // max(step_s, 1e-3)))
        return steps * (step_s + min(max(step_s, o.limit_min_seconds), o.limit_seconds) + self.STEP_OVERHEAD_S)

    @property
    def round_s(self) -> float:
        return sum(self.mode_s.values())

    def measured(self, runners: dict) -> None:
        """The partial modes' step time from their warm-up."""
        for k, r in runners.items():
            if r.warm_step_s:
                self.mode_s[k] = self._mode_s(r.warm_step_s)

    def calibration_deadline(self, first: bool) -> float | None:
        """A calibration pass's deadline: --calibration-seconds from now, and never past what the report (and, for
        the `first` pass, before any round, one round) still needs."""
        ends = []
        if self.calibration_s:
            ends.append(time.monotonic() + self.calibration_s)
        if self.clock.budget is not None:
            ends.append(self.clock.t_start + self.clock.budget - self.report_s - (self.round_s if first else 0.0))
        return min(ends) if ends else None

    def mode_deadline(self, mode: str, later: list[str]) -> float | None:
        """When `mode` starts no new step in this round: its share (by the planned times of it and the `later` modes
        of the round) of the time left before the report's reserve."""
        if self.clock.budget is None:
            return None
        left = self.clock.left() - self.report_s
        share = self.mode_s[mode] / (self.mode_s[mode] + sum(self.mode_s[m] for m in later))
        return time.monotonic() + max(0.0, left) * share

    def room_for(self, seconds: float, what: str) -> bool:
        """Whether `seconds` more fit before the report's reserve (printed when not)."""
        if self.clock.left() - self.report_s >= seconds:
            return True
        print(f"--time-budget {self.clock.budget:.0f}s: no room for {what} (~{seconds:.0f}s; {self.clock.left():.0f}s "
              f"left, {self.report_s:.0f}s kept for the report)", flush=True)
        return False

    def describe(self) -> str:
        out = (f"plan: {1e3 * self.step_s:.1f} ms per request in flight at C*; a round ~{self.round_s:.0f}s (a sync "
               f"step ~{self.sync_s:.1f}s)")
        if self.clock.budget is not None:
            out += (f"; --time-budget {self.clock.budget:.0f}s, {self.clock.left():.0f}s left: warm-up up to "
                    f"{self.warmup_s:.1f}s x {self.warm_runs}, calibration up to {self.calibration_s or 0:.0f}s, "
                    f"report {self.report_s:.0f}s")
        elif self.warmup_s is not None:
            out += f"; warm-up up to {self.warmup_s:.1f}s x {self.warm_runs}"
        return out

    def to_dict(self) -> dict:
        return {"budget_s": self.clock.budget, "step_ms": round(1e3 * self.step_s, 3), "sync_s": round(self.sync_s, 3),
                "round_s_planned": round(self.round_s, 1),
                "warmup_s": None if self.warmup_s is None else round(self.warmup_s, 1),
                "elapsed_s": round(self.clock.elapsed(), 1)}


# a fixed piece of pure-Python work: its time on the engines' CPU says how fast that CPU runs now (a shared host's
# neighbours can slow a VM's CPU by 20% for tens of seconds without any load showing inside the VM)
_SPEED_PROBE = ("import os, sys, time\nos.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')})\n"
                "best = 1e9\nfor _ in range(5):\n    t = time.perf_counter()\n"
                "    sum(i * i for i in range(100000))\n    best = min(best, time.perf_counter() - t)\nprint(best)")


async def box_speed(pinning: dict) -> float:
    """Seconds of the fixed probe (best of 5) in a process pinned to the engines' CPUs."""
    cpus = ",".join(str(c) for c in pinning["engines"])
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _SPEED_PROBE, cpus,
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return float(out.decode().strip())


def pin_processes(groups, engine_cpus: str | None, driver_cpus: str | None, separate: bool = False) -> dict:
    """Pin every engine process (all its threads) to `engine_cpus` and this driver and the routers to
    `driver_cpus` (default on a box of >= 2 CPUs: engines on the last CPU, the rest for the driver), the same
    for every mode and the limit, so modes never differ in where their work runs.

    `separate` (engines on a GPU): without --engine-cpus, each engine gets CPUs of its own (up to 3, the last ones)
    and the driver the rest. There an engine's step is the host's work (launching its kernels) and its HTTP side
    answers the requests: on one CPU shared by every engine, both halves of each contend, and a decode step took
    2x what the same engine took alone. "engines" is then the modes' engine's CPUs (where box_speed runs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 and not (engine_cpus or driver_cpus):
        return {"engines": cpus, "driver": cpus, "note": "one CPU: nothing pinned"}
    procs = [e for g in groups for e in g.engines]
    each = min(3, (len(cpus) - 2) // max(1, len(procs))) if separate and not engine_cpus else 0
    if each >= 1:
        own = [cpus[len(cpus) - (i + 1) * each: len(cpus) - i * each] for i in range(len(procs))]
        taken = {c for cs in own for c in cs}
        drv = _cpu_list(driver_cpus) if driver_cpus else [c for c in cpus if c not in taken]
        for e, cs in zip(procs, own):
            _pin_all_threads(e.pid, cs)
        eng = own[0]
    else:
        eng = _cpu_list(engine_cpus) if engine_cpus else cpus[-1:]
        drv = _cpu_list(driver_cpus) if driver_cpus else [c for c in cpus if c not in eng] or cpus
        for e in procs:
            _pin_all_threads(e.pid, eng)
    for g in groups:
        if g.router.process is not None:
            _pin_all_threads(g.router.process.pid, drv)
    _pin_all_threads(os.getpid(), drv)
    out = {"engines": eng, "driver": drv, "engine_threads": 1}
    if each >= 1:
        out["engine_cpus_each"] = own
    return out


def _cpu_list(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _pin_all_threads(pid: int, cpus: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass
