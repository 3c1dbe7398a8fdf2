"""Engine watchdog: no rollout waits on a dead or frozen engine. While a step runs, `EngineWatchdog` reads every
engine's process each `PROCESS_CHECK_S` and probes `GET /health_generate` (answered only while a scheduler makes
progress) each --rollout-health-check-interval; a fault is reported once and the step raises `EngineFaultError`."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Awaitable, Callable

import aiohttp

from slime.backends.sglang_utils import http_client

logger = logging.getLogger(__name__)

PROCESS_CHECK_S = 1.0
# how long an unreachable engine's host gets to report its process's exit before the refused connection is named
EXPLAIN_WAIT_S = 2.0


@dataclass(frozen=True)
class EngineFault:
    url: str
    rank: int | None  # engine rank in the EngineGroup (None: a worker we did not launch, or the router)
    problem: str  # e.g. "exited with code -9", "did not answer GET /health_generate within 30s"
    router: bool = False  # the fault is the group's sglang-router, not an engine

    def describe(self) -> str:
        if self.router:
            who = f"the sglang-router at {self.url}"
        else:
            who = f"engine {self.rank} ({self.url})" if self.rank is not None else f"worker {self.url}"
        return f"{who} {self.problem}"


def process_faults(faults, known) -> list[EngineFault]:
    """New faults (not in `known`) of the router and engines of `faults` (an EngineGroup's), read from the processes."""
    found = []
    router = faults.router_fault()
    if router is not None and router.url not in known:
        found.append(router)
    for url in list(faults.engine_urls):
        if url in known:
            continue
        problem = faults.engine_problem(url)
        if problem is not None:
            found.append(EngineFault(url, faults.engine_rank(url), problem))
    return found


class EngineFaultError(RuntimeError):
    """A rollout or eval step stopped because engines failed; `.faults` lists them (restartable by rank)."""

    def __init__(self, message: str, faults: list[EngineFault]):
        super().__init__(message)
        self.faults = list(faults)


class EngineWatchdog:
    """Watches `engines` (an EngineGroup) while a step runs; reports each failing engine once."""

    def __init__(self, args, engines, session, on_fault: Callable[[EngineFault], None] | None = None):
        self.engines, self.session, self.on_fault = engines, session, on_fault
        self.interval = float(args.rollout_health_check_interval)
        self.timeout = float(args.rollout_health_check_timeout)
        self.first_wait = float(args.rollout_health_check_first_wait)
        self.faults: dict[str, EngineFault] = {}
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set at each new fault (a running step waits on it)

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> "EngineWatchdog":
        if self._task is None and self.interval > 0:
            self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a probe error is not the step's error
                pass
            self._task = None

    async def __aenter__(self) -> "EngineWatchdog":
        return self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    # ---- checks ------------------------------------------------------------------
    def _report(self, fault: EngineFault) -> None:
        if fault.url in self.faults:
            return
        self.faults[fault.url] = fault
        logger.error("engine watchdog: %s", fault.describe())
        self.changed.set()
        if self.on_fault is not None:
            self.on_fault(fault)

    def check_processes(self) -> list[EngineFault]:
        """Exited / stopped router and engine processes (no I/O); reported and returned."""
        found = process_faults(self.engines.faults, self.faults)
        for fault in found:
            self._report(fault)
        return found

    async def explain_failure(self, wait: float = EXPLAIN_WAIT_S) -> list[EngineFault]:
        """A request failed: did the router or an engine die? Their processes are read for up to `wait` s (a
        killed process drops its connections a moment before its exit can be read)."""
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            found = self.check_processes()
            if found or self.faults or asyncio.get_running_loop().time() >= deadline:
                return found
            await asyncio.sleep(0.1)

    def explaining(self, request: Callable[..., Awaitable]) -> Callable[..., Awaitable]:
        """`request` (an async call through the router), but a failure first asks whether the router or an engine
        died, so the fault is reported before the caller sees the request's own error."""
        async def call(*args, **kwargs):
            try:
                return await request(*args, **kwargs)
            except Exception as e:
                lost = isinstance(e, (http_client.EngineUnreachableError, aiohttp.ClientError, ConnectionError)) or (
                    isinstance(e, http_client.EngineHTTPError) and e.status >= 500)
                await self.explain_failure(EXPLAIN_WAIT_S if lost else 0.0)
                raise

        return call

    async def _probe(self, url: str) -> EngineFault | None:
        try:
            await http_client.get(self.session, url, "/health_generate", timeout=self.timeout)
            return None
        except http_client.EngineUnreachableError as e:
            problem, wait = f"did not answer GET /health_generate ({e.cause})", EXPLAIN_WAIT_S
        except http_client.EngineHTTPError as e:
            problem, wait = f"answered GET /health_generate with HTTP {e.status}", 0.0
        # the process may explain it (stopped, exited): say that instead, giving its host a moment to see the exit
        why = self.engines.faults.engine_problem(url)
        deadline = asyncio.get_running_loop().time() + wait
        while why is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            why = self.engines.faults.engine_problem(url)
        return EngineFault(url, self.engines.faults.engine_rank(url), why or problem)

    async def check_once(self) -> list[EngineFault]:
        """One full check (processes, then HTTP health of the rest, concurrently); new faults are reported."""
        found = self.check_processes()
        urls = [u for u in self.engines.engine_urls if u not in self.faults]
        for fault in await asyncio.gather(*(self._probe(u) for u in urls)):
            if fault is not None and fault.url not in self.faults:
                self._report(fault)
                found.append(fault)
        return found

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_http = loop.time() + max(self.first_wait, self.interval)
        while True:
            self.check_processes()
            if loop.time() >= next_http:
                try:
                    await self.check_once()
                except Exception as e:  # noqa: BLE001 - the watchdog must never take the step down itself
                    logger.warning("engine watchdog: health check failed to run: %s", e)
                next_http = loop.time() + self.interval
            await asyncio.sleep(min(PROCESS_CHECK_S, self.interval))

    async def guard(self, coro):
        """Await `coro`; if an engine fails first, cancel it and raise `EngineFaultError`."""
        work = asyncio.ensure_future(coro)
        while not work.done():
            self.changed.clear()
            if self.faults:
                break
            waiter = asyncio.ensure_future(self.changed.wait())
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        elif work.exception() is not None and not self.faults:
            await self.check_once()  # a request failed: was it an engine dying before the next check?
        if self.faults:
            raise EngineFaultError("; ".join(f.describe() for f in self.faults.values()), list(self.faults.values()))
        return work.result()


class ProcessWatch:
    """For blocking phases (a weight sync): a thread reading every engine's (and the router's) process each second,
    calling `on_fault(fault)` (the caller kills a stopped engine, so the sync fails at once instead of timing out)."""

    def __init__(self, engines, on_fault: Callable[[EngineFault], None] | None = None, interval: float = PROCESS_CHECK_S):
        self.engines, self.on_fault, self.interval = engines, on_fault, interval
        self.faults: dict[str, EngineFault] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-process-watch", daemon=True)

    def __enter__(self) -> "ProcessWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self) -> list[EngineFault]:
        found = process_faults(self.engines.faults, self.faults)
        for fault in found:
            self.faults[fault.url] = fault
            logger.error("engine watchdog: %s", fault.describe())
            if self.on_fault is not None:
                self.on_fault(fault)
        return found

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception as e:  # noqa: BLE001 - the watch must not die silently mid-sync
                logger.warning("engine process watch: %s", e)
            if self._stop.wait(self.interval):
                return
