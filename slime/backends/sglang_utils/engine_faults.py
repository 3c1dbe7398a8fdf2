"""A group's faults: which engine (or the router) failed and why, read from the processes, and the restarts that
replace it. Its own state: the monitor of the placed engines' hosts."""

from __future__ import annotations

import logging

from slime.backends.sglang_utils import engine_api
from slime.backends.sglang_utils.engine_handle import HostMonitor
from slime.backends.sglang_utils.process_utils import ServerLaunchError
from slime.backends.sglang_utils.watchdog import EngineFault

logger = logging.getLogger(__name__)


class EngineFaults:
    """The faults of `group` (an EngineGroup: its `engines`, `router`, `placed`, `engine_urls`, `startup_timeout()`)."""

    def __init__(self, group):
        self.group = group
        self.monitor: HostMonitor | None = None  # placed engines: one thread asking every host how its server is

    @property
    def engine_urls(self) -> list[str]:
        return self.group.engine_urls

    def watch_hosts(self) -> None:
        if self.group.placed:
            self.monitor = HostMonitor(self.group.engines)
            self.monitor.refresh()
            self.monitor.start()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()

    def engine_rank(self, url: str) -> int | None:
        """The rank of the engine the group launched at `url` (None: not ours)."""
        return next((rank for rank, e in enumerate(self.group.engines) if e.url == url), None)

    def engine_problem(self, url: str) -> str | None:
        """What is wrong with our engine process at `url`, or None: from /proc, or for placed engines from the
        host monitor's last round (a problem it saw is confirmed before it is returned)."""
        rank = self.engine_rank(url)
        if rank is None:
            return None
        if not self.group.placed:
            return self.group.engines[rank].problem()
        if self.monitor is None or self.monitor.problems.get(url) is None:
            return None
        self.monitor.refresh([self.group.engines[rank]], timeout=5.0)
        return self.monitor.problems.get(url)

    def router_fault(self) -> EngineFault | None:
        """The router the group started, if its process exited or is stopped (an external router: never)."""
        router = self.group.router
        problem = router.problem() if router is not None else None
        return None if problem is None else EngineFault(router.url, None, problem, router=True)

    def check_alive(self) -> None:
        """Raises ServerLaunchError naming the first engine whose process is gone (with its log's tail)."""
        for engine in self.group.engines:
            problem = self.engine_problem(engine.url)
            if problem is not None:
                raise ServerLaunchError(f"{engine.name} {problem} while waiting for the router to list it; last lines "
                                        f"of {engine.log_path}:\n{engine.log_tail()}")

    def register(self, urls: list[str]) -> None:
        """Add `urls` to the router and wait until it lists them healthy (an engine process dying fails it)."""
        for url in urls:
            self.group.router.add_worker(url)
        self.group.router.wait_workers_healthy(urls, timeout=60.0, extra_check=self.check_alive)

    def restart_router(self, timeout: float = 60.0) -> None:
        """Start our router again on its port and register every engine with it again (they keep running)."""
        router = self.group.router
        waited = router.restart(timeout)
        self.register(self.engine_urls)
        logger.warning("sglang-router restarted at %s (pid %s) after %.1fs; %d engine(s) registered again",
                       router.url, router.process.pid, waited, len(self.group.engines))

    def kill_engine(self, rank: int) -> None:
        """Kill engine `rank` now, so whatever waits on it fails at once instead of timing out."""
        if 0 <= rank < len(self.group.engines):
            self.group.engines[rank].kill(grace=0.5)
            if self.monitor is not None:
                self.monitor.refresh([self.group.engines[rank]])

    def restart_engine(self, rank: int, timeout: float | None = None) -> str:
        """Replace engine `rank` with a fresh one (off the router, killed, relaunched on fresh ports, serving
        --hf-checkpoint at weight_version 0 until the caller re-syncs); returns its URL."""
        engines, router = self.group.engines, self.group.router
        if router is None or not 0 <= rank < len(engines):
            raise ValueError(f"restart_engine: no engine {rank} (this group has {len(engines)})")
        engine = engines[rank]
        old_url = engine.url
        try:
            router.remove_worker(old_url, timeout=10)
        except Exception as e:  # noqa: BLE001 - a router that cannot drop it still must get the new one
            logger.warning("could not remove %s from the router: %s", old_url, e)
        new_url = engine.restart(timeout or self.group.startup_timeout())
        engine_api.check_engine_versions([new_url])
        if self.monitor is not None:
            self.monitor.refresh([engine])
        self.register([new_url])
        logger.warning("engine %d restarted at %s (was %s)", rank, new_url, old_url)
        return new_url
