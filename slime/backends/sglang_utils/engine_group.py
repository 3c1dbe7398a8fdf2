"""EngineGroup: N rollout engines behind one sglang-router. Each engine's server is owned by an `EngineHost` (a
Ray actor on its placement-group bundle in a run); what the router does not route (aborts, pauses, weight
updates, loads) is fanned out to every worker it lists. `faults` and `weights` stand beside the processes."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import tempfile
import threading
import time

import aiohttp

from slime.backends.sglang_utils import engine_api, http_client
from slime.backends.sglang_utils.engine_faults import EngineFaults
from slime.backends.sglang_utils.engine_handle import LocalEngine, RemoteEngine, gather_hosts
from slime.backends.sglang_utils.engine_host import EngineSlot
from slime.backends.sglang_utils.fan_out import EngineGroupError, FanOut
from slime.backends.sglang_utils.process_utils import ServerLaunchError, pick_free_ports
from slime.backends.sglang_utils.router import Router
from slime.backends.sglang_utils.watchdog import EngineFaultError
from slime.backends.sglang_utils.weight_update import WeightPush

logger = logging.getLogger(__name__)

LOADS_URLS_TTL_S = 10.0  # how long `loads` trusts its worker list before asking the router again


class EngineGroup:
    def __init__(self, args, log_dir: str | None = None, startup_timeout: float | None = None,
                 slots: list[EngineSlot] | None = None):
        """`slots`: each engine's placement-group bundles (its host is a Ray actor there); None: hosts in this
        process."""
        self.args = args
        self.num_gpus_per_engine = args.rollout_num_gpus_per_engine
        self.num_engines = args.num_engines
        if slots is not None and len(slots) != self.num_engines:
            raise ValueError(f"EngineGroup: {self.num_engines} engines (--rollout-num-gpus / "
                             f"--rollout-num-gpus-per-engine) but {len(slots)} placement slots")
        self.slots = slots
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="slime_engines_")
        self._startup_timeout = startup_timeout or args.engine_startup_timeout
        self.backend: str | None = None
        self.engines: list[LocalEngine | RemoteEngine] = []
        self.router: Router | None = None
        self.fan_out = FanOut(lambda: self.worker_urls(), 2 * self.num_engines)
        self.faults = EngineFaults(self)
        self.weights = WeightPush(self.fan_out, self.num_gpus_per_engine, lambda: self.backend)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._load_urls: tuple[float, list[str]] | None = None  # (when, worker URLs) for `loads`

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> "EngineGroup":
        if self._started:
            raise RuntimeError("EngineGroup.start() called twice")
        self._started = True
        atexit.register(self.shutdown)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise
        return self

    @property
    def placed(self) -> bool:
        """Whether the engines' hosts are Ray actors on placement-group bundles."""
        return self.slots is not None

    def startup_timeout(self) -> float:
        return self._startup_timeout or (900.0 if self.backend == "sglang" else 180.0)

    def _start(self) -> None:
        t0 = time.monotonic()
        self.router = self._start_or_attach_router()
        if self.placed:
            self.engines = [RemoteEngine(self.args, rank, self.log_dir, slot) for rank, slot in enumerate(self.slots)]
            states = gather_hosts([e.actor.start.remote() for e in self.engines], "start", 120.0)
            for engine, state in zip(self.engines, states):
                engine.set_state(state)
        else:
            self.engines = [LocalEngine(self.args, rank, self.log_dir) for rank in range(self.num_engines)]
            for engine in self.engines:
                engine.start()
        backends = {e.backend for e in self.engines}
        if len(backends) != 1:
            raise EngineGroupError("--rollout-backend auto resolved differently on the engines' nodes: "
                                   + ", ".join(f"engine {e.rank} on {e.node_ip}: {e.backend}" for e in self.engines))
        self.backend = backends.pop()
        timeout = self.startup_timeout()
        if self.placed:
            gather_hosts([e.actor.wait_healthy.remote(timeout) for e in self.engines], "wait_healthy", timeout + 60)
            for engine, state in zip(self.engines, gather_hosts([e.actor.state.remote() for e in self.engines],
                                                                "state", 30.0)):
                engine.set_state(state)  # a relaunch on a lost port moved it
            self.faults.watch_hosts()
        else:
            # every engine concurrently; the first failure wins (with its log tail)
            for fut in [self.fan_out.pool.submit(e.wait_healthy, timeout) for e in self.engines]:
                fut.result(timeout=timeout + 120)
        # an unsupported SGLang fails the run now, not at the first weight update
        engine_api.check_engine_versions(self.engine_urls)
        self.faults.register(self.engine_urls)
        others = sorted(set(self.worker_urls()) - set(self.engine_urls))
        if others:
            engine_api.check_engine_versions(others)
        where = sorted({e.node_ip for e in self.engines})
        logger.info("EngineGroup: %d %s engine(s) %son %s behind %s ready in %.1fs (logs: %s)",
                    self.num_engines, self.backend, "(Ray actors) " if self.placed else "", ", ".join(where),
                    self.router.url, time.monotonic() - t0, self.log_dir)

    def _start_or_attach_router(self) -> Router:
        ip, port = self.args.sglang_router_ip, self.args.sglang_router_port
        if ip and port:
            try:
                router = Router.attach(f"http://{ip}:{port}", timeout=5.0)
            except ServerLaunchError:
                logger.info("no router answers at %s:%s; starting one there", ip, port)
            else:
                if self.args.router_extra_args:  # they would be silently ignored
                    raise ServerLaunchError(f"a router already runs at {ip}:{port}, so the --router-* flags "
                                            f"{' '.join(self.args.router_extra_args)} cannot reach it: it keeps its own")
                return router
        router_port, prom_port = pick_free_ports(2)
        return Router.start(self.args, port or router_port, prom_port, self.log_dir)

    # --- where the engines run ------------------------------------------------------------
    def engine_nodes(self) -> list[dict]:
        """Per engine rank: node_ip, node_id (None outside Ray), hostname, the host's pid, backend, gpu_ids."""
        if not self.placed:
            return [e.node() for e in self.engines]
        return gather_hosts([e.actor.node.remote() for e in self.engines], "node", 30.0)

    def engine_devices(self) -> list[tuple[int, ...] | None]:
        """Per engine rank: its bundles' node GPU indices (TP order), or None where no bundle says."""
        out: list[tuple[int, ...] | None] = []
        for rank in range(self.num_engines):
            ids = self.slots[rank].gpu_ids if self.placed else ()
            out.append(tuple(int(g) for g in ids) if ids and all(str(g).isdigit() for g in ids) else None)
        return out

    def shutdown(self, grace: float = 10.0) -> None:
        """Terminate the engines and the router we started (SIGTERM, SIGKILL after `grace`). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self.faults.stop()
        router, engines = self.router, list(self.engines)
        if router is not None and not router.owned:
            for engine in engines:  # an external router must not keep routing to engines that are gone
                try:
                    router.remove_worker(engine.url, timeout=5)
                except Exception as e:  # shutdown must go on
                    logger.warning("could not remove %s from the external router: %s", engine.url, e)
        threads = [threading.Thread(target=e.shutdown, args=(grace,), daemon=True) for e in engines
                   if self._can_shut_down(e)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=grace + 20)
        if router is not None:
            router.shutdown(grace=min(grace, 5.0))
        self.fan_out.close()
        logger.info("EngineGroup shut down (%d engines)", len(engines))

    @staticmethod
    def _can_shut_down(engine) -> bool:
        if isinstance(engine, LocalEngine):
            return True
        import ray

        return ray.is_initialized()  # after ray.shutdown the hosts (and their servers) are gone already

    def __enter__(self) -> "EngineGroup":
        return self if self._started else self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- addresses ---------------------------------------------------------------
    @property
    def router_url(self) -> str:
        if self.router is None:
            raise RuntimeError("EngineGroup is not started")
        return self.router.url

    @property
    def engine_urls(self) -> list[str]:
        """URLs of the engines this group launched (stable order = engine rank)."""
        return [e.url for e in self.engines]

    def worker_urls(self, timeout: float = 10.0) -> list[str]:
        """Every worker the router lists (GET /workers); raises `EngineFaultError` if our router died."""
        if self.router is None:
            raise RuntimeError("EngineGroup is not started")
        fault = self.faults.router_fault()
        if fault is not None:  # named as what it is (process, port, exit code), not as a refused connection
            raise EngineFaultError(fault.describe(), [fault])
        return sorted(w["url"] for w in self.router.list_workers(timeout))

    # --- the engines' requests -------------------------------------------------------------
    def load(self, timeout: float = 10.0) -> dict[str, object]:
        """Every worker's load report, by URL."""
        urls = self.worker_urls()
        futs = {u: self.fan_out.pool.submit(engine_api.load_sync, u, timeout) for u in urls}
        return self.fan_out.wait(futs, f"GET {engine_api.LOADS_PATH}", timeout=timeout + 5)

    async def loads(self, session: aiohttp.ClientSession, timeout: float = 10.0) -> list[dict]:
        """Every worker's per-DP-rank load dicts, queues included (--admission auto)."""
        now = time.monotonic()
        if self._load_urls is None or now - self._load_urls[0] > LOADS_URLS_TTL_S:
            self._load_urls = (now, await asyncio.to_thread(self.worker_urls))
        return await engine_api.rank_loads(session, self._load_urls[1], timeout)

    async def pause(self, mode: str, session: aiohttp.ClientSession | None = None, timeout: float = 60.0) -> None:
        """POST /pause_generation {"mode"} to every worker (abort | retract | in_place: SGLang's modes)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause: mode {mode!r} is not one of abort, retract, in_place")
        await self._post_all("/pause_generation", [{"mode": mode}], session, timeout)

    async def continue_generation(self, session: aiohttp.ClientSession | None = None, timeout: float = 60.0) -> None:
        await self._post_all("/continue_generation", [{}], session, timeout)

    async def abort_requests(self, rids: list[str], session: aiohttp.ClientSession | None = None,
                             timeout: float = 30.0) -> None:
        """POST /abort_request {"rid"} for each of `rids` to every worker (the router does not route aborts)."""
        if rids:
            await self._post_all("/abort_request", [{"rid": rid} for rid in rids], session, timeout)

    async def _post_all(self, path: str, bodies: list[dict], session, timeout: float) -> None:
        urls = await asyncio.to_thread(self.worker_urls)
        async with _session(session) as session:
            await asyncio.gather(*(http_client.post(session, u, path, body, timeout=timeout) for u in urls
                                   for body in bodies))

    def flush_cache(self, timeout: float = 60.0) -> dict | str | None:
        """POST /flush_cache through the router (it fans it out); a busy engine refuses (HTTP 400, raised)."""
        return http_client.post_json(self.router_url + "/flush_cache", None, timeout)

    def release_memory_occupation(self, tags: list[str] | None = None, timeout: float = 120.0) -> None:
        """POST /release_memory_occupation {"tags"} to every engine we launched (idle, --enable-memory-saver)."""
        self.fan_out.call("POST", "/release_memory_occupation", {"tags": tags}, timeout, urls=self.engine_urls)

    def resume_memory_occupation(self, tags: list[str] | None = None, timeout: float = 120.0) -> None:
        """POST /resume_memory_occupation {"tags"} to every engine this group launched."""
        self.fan_out.call("POST", "/resume_memory_occupation", {"tags": tags}, timeout, urls=self.engine_urls)

    # --- async ---------------------------------------------------------------------
    async def abort_all_until_idle(self, timeout: float = 60.0, interval: float = 0.01,
                                   session: aiohttp.ClientSession | None = None,
                                   exclude: set[str] | frozenset = frozenset()) -> float:
        """POST /abort_request {"abort_all": true} to every worker but `exclude`, until every load report shows no
        running or waiting request (bounded by `timeout`); returns seconds elapsed."""
        start = time.monotonic()
        # our router dead (a step stopping because of it): its workers are the engines we launched
        listed = self.engine_urls if self.faults.router_fault() is not None else await asyncio.to_thread(self.worker_urls)
        urls = [u for u in listed if u not in exclude]
        async with _session(session) as session:
            rounds = 0
            while True:
                rounds += 1
                left = max(1.0, timeout - (time.monotonic() - start))
                await asyncio.gather(*(http_client.post(session, u, "/abort_request", {"abort_all": True}, timeout=left)
                                       for u in urls))
                counts = await asyncio.gather(*(engine_api.busy(session, u, timeout=left) for u in urls))
                busy = dict(zip(urls, counts))
                elapsed = time.monotonic() - start
                if not any(busy.values()):
                    logger.info("abort_all_until_idle: %d worker(s) idle after %d round(s), %.3fs", len(urls), rounds, elapsed)
                    return elapsed
                if elapsed > timeout:
                    raise EngineGroupError(f"abort_all_until_idle: still busy after {elapsed:.1f}s ({rounds} rounds): "
                                           + ", ".join(f"{u}: {n} request(s)" for u, n in busy.items() if n))
                await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def _session(session: aiohttp.ClientSession | None):
    """`session`, or a new one closed on exit."""
    if session is not None:
        yield session
        return
    async with aiohttp.ClientSession() as own:
        yield own
