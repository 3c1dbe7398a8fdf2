"""sglang-router (0.3.2): start it (or attach to an existing one), register workers, read them back. Its circuit
breaker is off: 0.3.2 would answer every request 503 for 60 s after 10 failed ones; worker health is ours to check."""

from __future__ import annotations

import logging
import os
import re
import sys
import time

import requests

from slime.backends.sglang_utils import http_client
from slime.backends.sglang_utils.process_utils import ManagedProcess, ServerLaunchError, process_problem, read_log_tail

logger = logging.getLogger(__name__)

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")


def build_router_command(args, host: str, port: int, prometheus_port: int) -> list[str]:
    policy = args.sglang_router_policy
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"--sglang-router-policy: {policy!r} is not one of {ROUTER_POLICIES}")
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--prometheus-host", host,
        "--prometheus-port", str(prometheus_port),
        "--policy", policy,
        "--log-level", args.sglang_router_log_level,
        "--disable-circuit-breaker",
    ]
    timeout = args.sglang_router_request_timeout_secs
    if timeout:
        cmd += ["--request-timeout-secs", str(int(timeout))]
    return cmd + list(args.router_extra_args)  # upstream's --router-<flag> options, checked at parse time


def _url_key(url: str) -> str:
    return url.rstrip("/").replace("://localhost:", "://127.0.0.1:")


class Router:
    """A started (owned) or attached (external) sglang-router."""

    def __init__(self, url: str, process: ManagedProcess | None = None):
        self.url = url.rstrip("/")
        self.process = process

    @property
    def owned(self) -> bool:
        return self.process is not None

    @classmethod
    def start(cls, args, port: int, prometheus_port: int, log_dir: str, timeout: float = 60.0) -> "Router":
        host = args.sglang_router_ip or "127.0.0.1"
        cmd = build_router_command(args, host, port, prometheus_port)
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        proc = ManagedProcess("sglang-router", cmd, os.path.join(log_dir, "router.log")).start()
        router = cls(f"http://{connect_host}:{port}", proc)
        try:
            waited = proc.wait_http_ok(router.url + "/workers", timeout)
        except BaseException:
            proc.terminate(grace=2)
            raise
        logger.info("sglang-router up at %s after %.1fs", router.url, waited)
        return router

    @classmethod
    def attach(cls, url: str, timeout: float = 10.0) -> "Router":
        """Use an already-running router at `url` (checked with GET /workers)."""
        router = cls(url)
        router.list_workers(timeout=timeout)
        logger.info("using the existing sglang-router at %s", router.url)
        return router

    # --- diagnostics -----------------------------------------------------
    def log_tail(self, max_lines: int = 30) -> str:
        if self.process is None:
            return "<external router: its log is not ours>"
        return _ANSI.sub("", read_log_tail(self.process.log_path, max_lines))

    def _error(self, what: str) -> ServerLaunchError:
        return ServerLaunchError(f"sglang-router at {self.url} {what}; last lines of its log:\n{self.log_tail()}")

    def check_alive(self, doing: str) -> None:
        if self.process is not None and not self.process.is_alive():
            raise self._error(f"exited with code {self.process.returncode()} while {doing}")

    def problem(self) -> str | None:
        """What is wrong with the router process we started, naming its pid; None while it runs, or if not ours."""
        if self.process is None:
            return None
        problem = process_problem(self.process)
        return None if problem is None else f"(pid {self.process.pid}) {problem}"

    def restart(self, timeout: float = 60.0) -> float:
        """Start the router we own again on the same address (knowing no workers); returns seconds until it answered."""
        if self.process is None:
            raise ServerLaunchError(f"sglang-router at {self.url} was not started by this run, so it cannot be "
                                    "restarted")
        self.process.terminate(grace=2)  # whatever is left of the old one (a stopped one is killed)
        self.process.start()
        try:
            return self.process.wait_http_ok(self.url + "/workers", timeout)
        except BaseException:
            self.process.terminate(grace=2)
            raise

    # --- workers -----------------------------------------------------------
    def list_workers(self, timeout: float = 10.0) -> list[dict]:
        self.check_alive("listing workers")
        try:
            out = http_client.get_json(self.url + "/workers", timeout=timeout)
        except requests.RequestException as e:
            self.check_alive("listing workers")
            raise self._error(f"did not answer GET /workers ({type(e).__name__}: {e})") from e
        if not isinstance(out, dict) or not isinstance(out.get("workers"), list):
            raise self._error(f"answered GET /workers with an unexpected body: {out!r}")
        return out["workers"]

    def add_worker(self, url: str, timeout: float = 10.0) -> None:
        """POST /workers {"url"}; registration finishes asynchronously (see wait_workers_healthy)."""
        self.check_alive(f"registering worker {url}")
        resp = requests.post(self.url + "/workers", json={"url": url}, timeout=timeout)
        if resp.status_code not in (200, 201, 202):
            raise self._error(f"refused worker {url}: HTTP {resp.status_code} {resp.text[:500]}")

    def remove_worker(self, url: str, timeout: float = 10.0) -> bool:
        """DELETE /workers/{id} for the worker listed with `url`; False if it is not listed."""
        for w in self.list_workers(timeout):
            if _url_key(w.get("url", "")) == _url_key(url):
                resp = requests.delete(f"{self.url}/workers/{w['id']}", timeout=timeout)
                return 200 <= resp.status_code < 300
        return False

    def wait_workers_healthy(self, urls: list[str], timeout: float, interval: float = 0.25,
                             extra_check=None) -> float:
        """Poll GET /workers until every url in `urls` is listed healthy; returns seconds waited. `extra_check()` runs
        each round and may raise (an engine process died)."""
        want = {_url_key(u): u for u in urls}
        start = time.monotonic()
        while True:
            if extra_check is not None:
                extra_check()
            listed = {_url_key(w.get("url", "")): bool(w.get("is_healthy")) for w in self.list_workers()}
            missing = [u for k, u in want.items() if not listed.get(k)]
            if not missing:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                states = ", ".join(f"{u} ({'unhealthy' if _url_key(u) in listed else 'not listed'})" for u in missing)
                raise self._error(f"did not list worker(s) {states} as healthy within {timeout:.0f}s")
            time.sleep(interval)

    def shutdown(self, grace: float = 5.0) -> None:
        if self.process is not None:
            self.process.terminate(grace)
