"""GracefulStop (slime/utils/graceful_stop.py) in this process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from slime.utils.graceful_stop import GracefulStop, StopNow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_requests_the_stop_the_second_stops_at_once(sig):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with GracefulStop() as stop:
        assert not stop.requested and not stop.is_set()
        os.kill(os.getpid(), sig)  # (handled on this thread before the next line)
        assert stop.requested and stop.exit_code == 128 + sig
        assert stop.reason == ("SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM") + " received"
        with pytest.raises(StopNow) as raised:
            os.kill(os.getpid(), sig)
        assert raised.value.exit_code == 128 + sig and "received again while stopping" in str(raised.value)
        assert stop.at_once is raised.value  # (kept: Ray's waits re-raise it as a plain KeyboardInterrupt)
        assert {s: signal.getsignal(s) for s in before} == before  # a third signal is no longer ours
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_request_wakes_waiters_on_other_threads_loops_and_a_late_waiter_returns_at_once():
    stop = GracefulStop()
    waiting = threading.Barrier(3)

    def waiter(out: list):
        async def run():
            task = asyncio.ensure_future(stop.wait())
            await asyncio.sleep(0)  # registered
            waiting.wait()
            await asyncio.wait_for(task, 60)
            out.append(stop.reason)

        asyncio.run(run())

    results: list = []
    threads = [threading.Thread(target=waiter, args=(results,)) for _ in range(2)]
    for t in threads:
        t.start()
    waiting.wait()
    stop.request("asked", 7)
    for t in threads:
        t.join(60)
    assert results == ["asked", "asked"] and stop.exit_code == 7 and not stop._waiters
    stop.request("again", 9)  # the first request stands
    assert (stop.reason, stop.exit_code) == ("asked", 7)
    asyncio.run(asyncio.wait_for(stop.wait(), 5))


def test_exit_duration_requests_the_stop_by_itself():
    with GracefulStop(exit_duration_in_mins=0.001) as stop:
        asyncio.run(asyncio.wait_for(stop.wait(), 60))
        assert stop.exit_code == 0 and stop.reason.startswith("--exit-duration-in-mins 0.001 reached (")



def test_outside_with_it_installs_nothing():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    GracefulStop().install()  # (a TrainingRun made without the entry point's stop installs again after ray.init)
    assert {s: signal.getsignal(s) for s in before} == before
