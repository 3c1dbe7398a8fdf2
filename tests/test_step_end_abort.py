"""The end-of-step abort leaves an engine that fails while the abort waits on it (StepEnd._abort_live_engines).

An engine stopped just before a step ends (SIGSTOP, a hung GPU) accepts the abort's connection and never answers;
the watchdog names it a moment later. Before, the abort waited out --rollout-abort-timeout (120 s) on it.
"""

from __future__ import annotations

import asyncio
import time

from slime.rollout.step_end import StepEnd


class Engines:
    """abort_all_until_idle as EngineGroup's: `exclude` are known-dead URLs; a stopped one never answers."""

    def __init__(self, urls, stopped):
        self.urls, self.stopped, self.calls = urls, stopped, []

    async def abort_all_until_idle(self, timeout, session=None, exclude=frozenset()):
        self.calls.append(set(exclude))
        live = [u for u in self.urls if u not in exclude]
        if set(live) & self.stopped:
            await asyncio.sleep(timeout)
            raise TimeoutError(f"no reply within {timeout}s")
        return 0.01 * len(live)


class Step(StepEnd):
    def __init__(self, engines, timeout=30.0):
        self.ctx = type("Ctx", (), {"engines": engines})()
        self.abort_timeout, self.rollout_id = timeout, 3
        self.faults, self.fault_seen = {}, asyncio.Event()

    def fault(self, url):
        self.faults[url] = object()
        self.fault_seen.set()


def test_an_engine_failing_during_the_abort_leaves_it_at_once():
    async def main():
        engines = Engines(["u0", "u1"], stopped={"u0"})
        step = Step(engines)
        task = asyncio.create_task(step._abort_live_engines(None))
        await asyncio.sleep(0.1)
        assert not task.done()  # waiting on the stopped engine
        step.fault("u0")  # the watchdog names it
        t0 = time.monotonic()
        res = await asyncio.wait_for(task, 5)
        return res, time.monotonic() - t0, engines.calls

    res, waited, calls = asyncio.run(main())
    assert res == 0.01 and waited < 1.0  # the live engine alone, at once (not the 30 s timeout)
    assert calls == [set(), {"u0"}]


def test_a_repeated_fault_does_not_restart_the_abort_and_known_faults_are_excluded_up_front():
    async def main():
        engines = Engines(["u0", "u1", "u2"], stopped=set())
        step = Step(engines)
        step.fault("u2")  # known before the abort: excluded from the first call
        step.fault_seen.set()  # a second report of the same engine while the abort runs changes nothing
        return await step._abort_live_engines(None), engines.calls

    res, calls = asyncio.run(main())
    assert res == 0.02 and calls == [{"u2"}]


def test_an_abort_that_fails_on_its_own_still_raises():
    async def main():
        step = Step(Engines(["u0"], stopped={"u0"}), timeout=0.2)
        try:
            await step._abort_live_engines(None)
        except TimeoutError as e:
            return str(e)

    assert "no reply" in asyncio.run(main())
