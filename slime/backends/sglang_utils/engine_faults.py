"""EngineGroup's faults: which engine (or the router) is at fault and what is wrong with it, read from the
processes (slime/backends/sglang_utils/watchdog.py asks), and the restarts that replace it (the RolloutManager's
`restart_engines`)."""

from __future__ import annotations

import logging

from slime.backends.sglang_utils import engine_api
from slime.backends.sglang_utils.watchdog import EngineFault

logger = logging.getLogger(__name__)


class EngineFaultsMixin:
    """Needs `engines`, `router`, `placed`, `_monitor`, `engine_urls`, `_timeout()` and `_check_engines_alive`
    from EngineGroup."""

    def engine_rank(self, url: str) -> int | None:
        """The rank of the engine this group launched at `url` (None: not ours)."""
        for rank, engine in enumerate(self.engines):
            if engine.url == url:
                return rank
        return None

    def engine_problem(self, url: str) -> str | None:
        """What is wrong with our engine process at `url` (exited, stopped, zombie; a host actor gone), or None.
        Local processes are read from /proc; placed ones from the host monitor's last round (<= 0.5 s old, no I/O
        while it says running; a problem it saw is asked again before it is returned, so a stale one is never
        acted on)."""
        rank = self.engine_rank(url)
        if rank is None:
            return None
        if not self.placed:
            return self.engines[rank].problem()
        if self._monitor is None or self._monitor.problems.get(url) is None:
            return None
        self._monitor.refresh([self.engines[rank]], timeout=5.0)  # a fault is confirmed before it is acted on
        return self._monitor.problems.get(url)

    def router_fault(self) -> EngineFault | None:
        """The router this group started, if its process exited or is stopped (an external router: never)."""
        problem = self.router.problem() if self.router is not None else None
        return None if problem is None else EngineFault(self.router.url, None, problem, router=True)

    def restart_router(self, timeout: float = 60.0) -> None:
        """Start our router again on its port, with the same flags, and register every engine with it again (the
        engines keep running, their weights and requests untouched). Raises ServerLaunchError if it does not come
        up or does not list the engines as healthy."""
        waited = self.router.restart(timeout)
        for engine in self.engines:
            self.router.add_worker(engine.url)
        self.router.wait_workers_healthy(self.engine_urls, timeout=60.0, extra_check=self._check_engines_alive)
        logger.warning("sglang-router restarted at %s (pid %s) after %.1fs; %d engine(s) registered again",
                       self.router.url, self.router.process.pid, waited, len(self.engines))

    def kill_engine(self, rank: int) -> None:
        """Kill engine `rank` now (a stopped one too), so whatever waits on it fails at once instead of timing out."""
        if 0 <= rank < len(self.engines):
            self.engines[rank].kill(grace=0.5)
            if self._monitor is not None:
                self._monitor.refresh([self.engines[rank]])

    def restart_engine(self, rank: int, timeout: float | None = None) -> str:
        """Replace engine `rank` (dead, frozen or misbehaving) with a fresh one; returns its URL.

        The old one is taken off the router and killed by its host (SIGTERM, then SIGKILL: a stopped process gets
        it too); the host starts a new one on its node on fresh ports with the same flags (so it serves the
        --hf-checkpoint weights at weight_version 0 until the caller re-syncs the current ones), and it is added
        to the router once healthy. Raises ServerLaunchError (with the log tail) if it does not come up.
        """
        if self.router is None or not 0 <= rank < len(self.engines):
            raise ValueError(f"restart_engine: no engine {rank} (this group has {len(self.engines)})")
        engine = self.engines[rank]
        old_url = engine.url
        try:
            self.router.remove_worker(old_url, timeout=10)
        except Exception as e:  # noqa: BLE001 - a router that cannot drop it still must get the new one
            logger.warning("could not remove %s from the router: %s", old_url, e)
        new_url = engine.restart(timeout or self._timeout())
        engine_api.check_engine_versions([new_url])
        if self._monitor is not None:
            self._monitor.refresh([engine])
        self.router.add_worker(new_url)
        self.router.wait_workers_healthy([new_url], timeout=60.0, extra_check=self._check_engines_alive)
        logger.warning("engine %d restarted at %s (was %s)", rank, new_url, old_url)
        return new_url
