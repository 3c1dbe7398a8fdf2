"""How EngineGroup reaches an engine's host, with one interface: in-process (`LocalEngine`, tools and tests) or a Ray
actor on its bundle (`RemoteEngine`), whose problem is what `HostMonitor` last heard (no I/O in the watchdog's
check); errors raised in a host come back as themselves.
"""

from __future__ import annotations

import logging
import threading
import time

from slime.backends.sglang_utils.engine_host import (HOST_MAX_CONCURRENCY, HOST_NUM_CPUS, HOST_NUM_GPUS, EngineHost,
                                                     EngineSlot)
from slime.backends.sglang_utils.process_utils import ServerLaunchError

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the monitor asks every remote host about its process
CALL_TIMEOUT_S = 30.0  # a host's quick calls (state, kill, log tail)
MONITOR_TIMEOUT_S = 10.0  # a host that does not answer the monitor this long is reported


class _EngineState:
    """What a host last reported about its server: url, pid, log path (both handles read the same dict)."""

    _state: dict

    @property
    def url(self) -> str:
        return self._state["url"]

    @property
    def pid(self) -> int:
        return self._state["pid"]

    @property
    def log_path(self) -> str:
        return self._state["log_path"]


class LocalEngine(_EngineState, EngineHost):
    """A host in this process; url, pid and log path as of its last start, health wait or restart."""

    node_ip = "127.0.0.1"

    def __init__(self, args, rank: int, log_dir: str, backend: str | None = None):
        super().__init__(args, rank, log_dir, backend=backend)
        self._state: dict = {}

    @property
    def name(self) -> str:
        return self._state.get("name", f"engine {self.rank}")

    def start(self) -> "LocalEngine":
        self._state = super().start()
        return self

    def wait_healthy(self, timeout: float) -> float:
        waited = super().wait_healthy(timeout)
        self._state = self.state()  # a relaunch on a lost port moves it
        return waited

    def restart(self, timeout: float) -> str:
        self._state = super().restart(timeout)
        return self.url


def host_result(ref, timeout: float, what: str):
    """ray.get raising the host's own exception, or ServerLaunchError naming `what` (a timeout, a dead actor)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise
    except ray.exceptions.GetTimeoutError:
        raise ServerLaunchError(f"{what}: no answer within {timeout:.0f}s") from None
    except ray.exceptions.RayActorError as e:
        raise ServerLaunchError(f"{what}: its host actor died ({type(e).__name__}: {str(e).splitlines()[0]})") from e


def gather_hosts(refs: list, what: str, timeout: float) -> list:
    """Every engine host's answer, one deadline; the first failure (the host's own error) is raised."""
    import ray

    pending = {ref: rank for rank, ref in enumerate(refs)}
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
        if not ready:
            raise ServerLaunchError(f"engine host(s) {sorted(pending.values())}: {what} did not answer within "
                                    f"{timeout:.0f}s")
        for ref in ready:
            rank = pending.pop(ref)
            out[rank] = host_result(ref, 5.0, f"engine {rank} {what}")
    return [out[r] for r in range(len(refs))]


class RemoteEngine(_EngineState):
    """A host as a Ray actor on `slot` (its placement-group bundle); re-created there if the actor dies."""

    def __init__(self, args, rank: int, log_dir: str, slot: EngineSlot, backend: str | None = None):
        self.args, self.rank, self.log_dir, self.slot = args, rank, log_dir, slot
        self.node_ip = slot.node_ip
        self.backend = backend
        self._state: dict = {}
        self.actor = None
        self._new_actor()

    def _new_actor(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(EngineHost)
        self.actor = cls.options(
            num_cpus=HOST_NUM_CPUS,
            num_gpus=HOST_NUM_GPUS if self.slot.gpu_ids else 0,
            max_concurrency=HOST_MAX_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.slot.placement_group,
                                                                 placement_group_bundle_index=self.slot.bundle_index),
        ).remote(self.args, self.rank, self.log_dir, self.slot.gpu_ids, self.backend)

    @property
    def name(self) -> str:
        return f"{self._state.get('name', f'engine {self.rank}')} on node {self.node_ip}"

    def _call(self, method: str, *a, timeout: float = CALL_TIMEOUT_S):
        return host_result(getattr(self.actor, method).remote(*a), timeout, f"engine {self.rank} {method}")

    def start(self) -> "RemoteEngine":
        self.set_state(self._call("start", timeout=CALL_TIMEOUT_S + 60))
        return self

    def set_state(self, state: dict) -> None:
        self._state = state
        self.backend = state["backend"]

    def wait_healthy(self, timeout: float) -> float:
        waited = self._call("wait_healthy", timeout, timeout=timeout + 60)
        self._state = self._call("state")
        return waited

    def restart(self, timeout: float) -> str:
        import ray

        try:
            self._state = self._call("restart", timeout, timeout=timeout + 90)
        except ServerLaunchError as e:
            if "host actor died" not in str(e):
                raise
            logger.warning("engine %d: its host actor is gone (%s); starting a new one on bundle %d", self.rank, e,
                           self.slot.bundle_index)
            ray.kill(self.actor)
            self._new_actor()
            self.start()
            self.wait_healthy(timeout)
        return self.url

    def kill(self, grace: float = 0.5) -> None:
        """Kill the server; if the host does not answer, kill the host actor (its server dies with it)."""
        import ray

        try:
            self._call("kill", grace, timeout=grace + 15)
        except ServerLaunchError as e:
            logger.warning("engine %d: %s; killing its host actor", self.rank, e)
            ray.kill(self.actor)

    def shutdown(self, grace: float = 10.0) -> None:
        import ray

        try:
            self._call("shutdown", grace, timeout=grace + 15)
        except Exception as e:  # noqa: BLE001 - the actor goes anyway
            logger.warning("engine %d shutdown: %s", self.rank, e)
        ray.kill(self.actor)

    def check_alive(self, doing: str) -> None:
        self._call("check_alive", doing)

    def log_tail(self, max_lines: int = 40) -> str:
        return self._call("log_tail", max_lines)


class HostMonitor:
    """One thread asking every remote host, every POLL_S, what is wrong with its server process: `problems[url]`
    (None: running; a host gone or silent for MONITOR_TIMEOUT_S is a problem too)."""

    def __init__(self, engines: list[RemoteEngine]):
        self.engines = engines
        self.problems: dict[str, str | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-host-monitor", daemon=True)

    def start(self) -> "HostMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=MONITOR_TIMEOUT_S + 5)

    def refresh(self, engines: list[RemoteEngine] | None = None, timeout: float = MONITOR_TIMEOUT_S) -> None:
        """Ask the hosts now (all at once) and record their answers."""
        import ray

        engines = list(self.engines if engines is None else engines)
        refs = {e.actor.state.remote(): e for e in engines}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
        ready = set(ready)
        for ref, engine in refs.items():
            url = engine._state.get("url")
            if ref not in ready:
                if url is not None:
                    self.problems[url] = f"(its host actor on node {engine.node_ip} did not answer for {timeout:.0f}s)"
                continue
            try:
                state = ray.get(ref, timeout=1)
                self.problems[state["url"]] = state["problem"]
            except ray.exceptions.RayActorError as e:
                if url is not None:
                    self.problems[url] = f"is gone with its host actor on node {engine.node_ip} ({type(e).__name__})"
            except Exception as e:  # noqa: BLE001 - a host that cannot report is not the monitor's end
                logger.debug("engine %d state: %s", engine.rank, e)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - e.g. Ray shutting down under us
                if self._stop.is_set():
                    return
                logger.warning("engine host monitor: %s", e)
                time.sleep(POLL_S)
