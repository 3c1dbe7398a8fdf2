"""EngineHost: owns one rollout engine's server process on its node (in a run a Ray actor on the engine's
placement-group bundle). The server is launched from the host's own long-lived thread, to which its
PR_SET_PDEATHSIG is tied, so it dies with the host and never with a short-lived caller."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from slime.backends.sglang_utils.process_utils import (SGLANG_MAX_PORT, ServerLaunchError, pick_free_ports,
                                                       process_problem)
from slime.backends.sglang_utils.sglang_engine import EngineProcess, make_engine_process, resolve_rollout_backend
from slime.utils.net import WILDCARDS, resolve_listen_host
from slime.utils.paths import SHARED_STORAGE_HINT, PathNotVisibleError, path_problems
from slime.utils.run import process_placement

logger = logging.getLogger(__name__)

# The host actor's Ray resources inside its bundle: no CPU, a fifth of a GPU (a colocated trainer shares both)
HOST_NUM_CPUS = 0.0
HOST_NUM_GPUS = 0.2
HOST_MAX_CONCURRENCY = 8  # problem() / log_tail() are answered while a start or restart waits


@dataclass(frozen=True)
class EngineSlot:
    """Where an engine runs: its placement-group bundles (the host on the first) and their GPUs (empty on CPU)."""

    placement_group: object
    bundle_indices: tuple[int, ...]
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()

    @property
    def bundle_index(self) -> int:
        return self.bundle_indices[0]


class EngineHost:
    """One engine server: launch, health wait, problem, kill, restart, log; thread-safe (max_concurrency)."""

    def __init__(self, args, rank: int, log_dir: str, gpu_ids: tuple[str, ...] = (), backend: str | None = None):
        self.args = args
        self.rank = rank
        self.log_dir = log_dir
        self.gpu_ids = tuple(str(g) for g in gpu_ids)
        self.backend = backend or resolve_rollout_backend(args)
        self.engine: EngineProcess | None = None
        self._used_ports: set[int] = set()
        self._lock = threading.Lock()
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{rank}-launcher")

    # --- where ------------------------------------------------------------------
    def node(self) -> dict:
        """Where this host runs (`process_placement`), its backend, GPUs, server URL and pid."""
        info = process_placement()
        engine = self.engine
        info.update(backend=self.backend, gpu_ids=list(self.gpu_ids), url=None if engine is None else engine.url,
                    server_pid=None if engine is None else engine.process.pid)
        return info

    def _check_paths(self) -> None:
        problems = path_problems([("--hf-checkpoint", self.args.hf_checkpoint, "hf_dir")])
        if problems:
            where = self.node()["node_ip"] or socket.gethostname()
            raise PathNotVisibleError(f"engine {self.rank} on node {where}: " + "; ".join(problems)
                                      + f" ({SHARED_STORAGE_HINT})")

    # --- lifecycle --------------------------------------------------------------
    def start(self) -> dict:
        """Launch the server on fresh ports (not waiting for it); returns `state()`."""
        self._check_paths()
        return self._launcher.submit(self._launch).result()

    def _launch(self) -> dict:  # on the launcher thread
        host = resolve_listen_host(self.args.listen_host)
        with self._lock:
            ports = pick_free_ports(2, exclude=self._used_ports, host="0.0.0.0" if host in WILDCARDS else host,
                                    max_port=SGLANG_MAX_PORT)
            self._used_ports.update(ports)
            self.engine = make_engine_process(self.args, self.backend, self.rank, ports[0], self.log_dir,
                                              nccl_port=ports[1], host=host, gpu_ids=self.gpu_ids or None).start()
        return self.state()

    def wait_healthy(self, timeout: float) -> float:
        """Wait for GET /health_generate; a port taken between picking and binding gets one relaunch."""
        engine = self._current()
        try:
            return engine.wait_healthy(timeout)
        except ServerLaunchError:
            if engine.process.is_alive() or "address already in use" not in engine.process.log_tail(200).lower():
                raise
            logger.warning("%s lost its port %d to another process; relaunching", engine.name, engine.port)
            engine.process.terminate(grace=1)
            self._launcher.submit(self._launch).result()
            return self._current().wait_healthy(timeout)

    def restart(self, timeout: float) -> dict:
        """Kill the server (a stopped one too) and start a fresh one on new ports; returns `state()` once healthy."""
        old = self.engine
        if old is not None:
            old.process.terminate(grace=5)
            logger.warning("restarting engine %d (was %s); its log continues in %s", self.rank, old.url,
                           old.process.log_path)
        self.start()
        self.wait_healthy(timeout)
        return self.state()

    def kill(self, grace: float = 0.5) -> None:
        if self.engine is not None:
            self.engine.process.terminate(grace=grace)

    def shutdown(self, grace: float = 10.0) -> None:
        if self.engine is not None:
            self.engine.process.terminate(grace)
        self._launcher.shutdown(wait=False)

    # --- state ------------------------------------------------------------------
    def _current(self) -> EngineProcess:
        if self.engine is None:
            raise RuntimeError(f"engine {self.rank} was not started")
        return self.engine

    def problem(self) -> str | None:
        """What is wrong with the server process (exited, stopped, zombie), or None."""
        engine = self.engine
        return None if engine is None else process_problem(engine.process)

    def check_alive(self, doing: str) -> None:
        self._current().process.check_alive(doing)

    def log_tail(self, max_lines: int = 40) -> str:
        return self._current().process.log_tail(max_lines)

    def state(self) -> dict:
        engine = self._current()
        return {"url": engine.url, "pid": engine.process.pid, "log_path": engine.process.log_path,
                "name": engine.name, "backend": self.backend, "problem": self.problem(), "time": time.time()}
