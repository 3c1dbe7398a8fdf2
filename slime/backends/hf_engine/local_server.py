"""The embedded engine as a subprocess on a free loopback port (tools, benchmarks, tests)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """`python -m slime.backends.hf_engine` on a free loopback port; `.stop()` sends SIGTERM and waits."""

    def __init__(self, model_path: str, extra_args: list[str] | None = None, log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra_args = list(extra_args or [])
        if "--weight-version" not in extra_args:  # as a run launches it (SGLang's own default is "default")
            extra_args += ["--weight-version", "0"]
        cmd = [sys.executable, "-m", "slime.backends.hf_engine", "--model-path", str(model_path),
               "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self._log = open(log_path, "w") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    def wait_healthy(self, timeout: float = 120.0) -> "EngineServer":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self.proc.returncode} before becoming healthy")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine at {self.url} not healthy after {timeout}s")

    def post(self, path: str, json=None, timeout: float = 60.0) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=timeout)

    def get(self, path: str, timeout: float = 10.0) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def load(self) -> dict:
        """The engine's one DP rank in SGLang's `GET /v1/loads?include=core` (num_running_reqs, num_waiting_reqs,
        num_used_tokens, ...)."""
        r = self.get("/v1/loads?include=core")
        r.raise_for_status()
        return r.json()["loads"][0]

    def weight_version(self) -> str:
        return self.get("/model_info").json()["weight_version"]

    def stats(self) -> dict:
        """The scheduler's cumulative counters (`/server_info` internal_states: slime/backends/hf_engine/stats.py)."""
        return self.get("/server_info").json()["internal_states"][0]["scheduler_stats"]

    @contextlib.contextmanager
    def weight_update_session(self):
        """SGLang's `/begin_weight_update` ... `/end_weight_update` around tensor / broadcast updates."""
        r = self.post("/begin_weight_update", {})
        assert r.status_code == 200, r.text
        try:
            yield
        finally:
            r = self.post("/end_weight_update", {})
            assert r.status_code == 200, r.text

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode
