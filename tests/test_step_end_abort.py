"""The end-of-step abort leaves an engine that fails while the abort waits on it (step.abort_live_engines)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from slime.rollout.staleness import StalenessCap
from slime.rollout.step import abort_live_engines
from slime.rollout.step_record import StepConfig, StepRecord


class Engines:
    """abort_all_until_idle as EngineGroup's: `exclude` are known-dead URLs; a stopped one never answers."""

    def __init__(self, urls, stopped):
        self.urls, self.stopped, self.calls, self.cancelled = urls, stopped, [], []

    async def abort_all_until_idle(self, timeout, session=None, exclude=frozenset()):
        self.calls.append(set(exclude))
        live = [u for u in self.urls if u not in exclude]
        if set(live) & self.stopped:
            try:
                await asyncio.sleep(timeout)
            except asyncio.CancelledError:
                self.cancelled.append(set(exclude))
                raise
            raise TimeoutError(f"no reply within {timeout}s")
        return 0.01 * len(live)


class Step:
    """A step's record, the engines it aborts and the watchdog's reports (what abort_live_engines reads)."""

    def __init__(self, engines, timeout=30.0):
        config = StepConfig(rollout_id=3, n=1, partial=True, cap=StalenessCap(), policy_version=0,
                            train_version=lambda: 0, rpc_timeout=30.0, abort_timeout=timeout, reward_settle_s=30.0)
        self.state = StepRecord(config, target=1, in_flight_cap=1, chunk=None)
        self.watchdog = SimpleNamespace(faults={}, changed=asyncio.Event())
        self.io = SimpleNamespace(engines=engines, session=None, watchdog=self.watchdog)
        self.fault_seen = self.watchdog.changed

    def fault(self, url):
        self.watchdog.faults[url] = object()
        self.watchdog.changed.set()

    def _abort_live_engines(self, session):
        return abort_live_engines(self.state, self.io)


def test_an_engine_failing_during_the_abort_leaves_it_at_once():
    async def main():
        engines = Engines(["u0", "u1"], stopped={"u0"})
        step = Step(engines, timeout=3600.0)  # a wait on the stopped engine would outlast this test
        task = asyncio.create_task(step._abort_live_engines(None))
        await asyncio.sleep(0.1)
        assert not task.done()  # waiting on the stopped engine
        step.fault("u0")  # the watchdog names it
        res = await asyncio.wait_for(task, 60)  # a safety net: the fault ends the wait, not a timeout
        return res, engines.calls, engines.cancelled

    res, calls, cancelled = asyncio.run(main())
    assert res == 0.01  # the live engine alone
    # the abort waiting on the stopped engine was cancelled when the fault was seen, then repeated without it
    assert calls == [set(), {"u0"}] and cancelled == [set()]


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
