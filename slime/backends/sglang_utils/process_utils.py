"""Child server processes: launched in their own process group, logging to a file, waited for on an HTTP route,
terminated (SIGTERM, then SIGKILL) without leaving orphans."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import requests

from slime.utils.redact import redact_argv

logger = logging.getLogger(__name__)


class ServerLaunchError(RuntimeError):
    """A child server died or did not become healthy in time; the message names it and shows its log tail."""


# SGLang reserves port + 10000 for its gRPC server and refuses a server port above this
SGLANG_MAX_PORT = 65535 - 10000


def pick_free_ports(n: int, exclude: set[int] | None = None, host: str = "127.0.0.1",
                    max_port: int = 65535) -> list[int]:
    """`n` distinct free TCP ports on `host`, none in `exclude` or above `max_port` (the OS picks them; if it keeps
    answering above `max_port`, ports below it are tried in turn)."""
    exclude = set(exclude or ())
    socks: list[socket.socket] = []
    ports: list[int] = []
    candidates = iter(range(20000, max_port + 1))
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            if len(socks) <= 64:
                s.bind((host, 0))
            else:  # the ephemeral range is above max_port: scan below it
                candidate = next(candidates, None)
                if candidate is None:
                    raise RuntimeError(f"no {n} free TCP ports at or below {max_port} on {host}")
                try:
                    s.bind((host, candidate))
                except OSError:
                    continue
            port = s.getsockname()[1]
            if port not in exclude and port not in ports and port <= max_port:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


def read_log_tail(path: str, max_lines: int = 40, max_bytes: int = 64_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode("utf-8", errors="replace")
    except OSError as e:
        return f"<could not read log {path}: {e}>"
    lines = data.splitlines()[-max_lines:]
    return "\n".join(lines) if lines else "<log is empty>"


# a killed multi-threaded process shows as a zombie while its threads exit; its exit code follows within moments
ZOMBIE_REAP_WAIT_S = 2.0


class ManagedProcess:
    """One child server process, started in its own session (process group)."""

    def __init__(self, name: str, cmd: list[str], log_path: str, env: dict[str, str] | None = None):
        self.name = name
        self.cmd = list(cmd)
        self.log_path = log_path
        self._env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ManagedProcess":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        logger.info("starting %s: %s (log: %s)", self.name, " ".join(redact_argv(self.cmd)), self.log_path)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env,
                start_new_session=True,
                # SIGTERM if the launching thread dies (even by SIGKILL): a killed trainer leaves no orphan servers
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, max_lines: int = 40) -> str:
        return read_log_tail(self.log_path, max_lines)

    def error(self, what: str) -> ServerLaunchError:
        return ServerLaunchError(
            f"{self.name} {what} (pid {self.pid}, cmd: {' '.join(redact_argv(self.cmd))}); last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def check_alive(self, doing: str = "running") -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise self.error(f"exited with code {self.proc.returncode} while {doing}")

    def wait_http_ok(self, url: str, timeout: float, interval: float = 0.25) -> float:
        """Poll GET `url` until it answers 2xx; returns seconds waited. Raises ServerLaunchError (with the log tail)
        if the process dies or the timeout passes."""
        start = time.monotonic()
        last_err = "no attempt"
        while True:
            self.check_alive(f"waiting for {url}")
            try:
                resp = requests.get(url, timeout=min(5.0, max(0.5, timeout)))
                if 200 <= resp.status_code < 300:
                    return time.monotonic() - start
                last_err = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except requests.RequestException as e:
                last_err = f"{type(e).__name__}: {e}"
            if time.monotonic() - start > timeout:
                raise self.error(f"did not answer {url} within {timeout:.0f}s (last: {last_err})")
            time.sleep(interval)

    def terminate(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `grace` s, then SIGKILL it. Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM for %.0fs; sending SIGKILL", self.name, pgid, grace)
        # Kill stragglers in the group (children of the server) even if the leader already exited.
        if process_group_members(pgid):
            _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %s) still alive after SIGKILL", self.name, pgid)
        # SIGKILL is asynchronous: return once the group is gone, so the port and the GPU are free for the caller
        deadline = time.monotonic() + 5
        while process_group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if process_group_members(pgid):
            logger.error("%s: processes %s of group %s still alive after SIGKILL", self.name, process_group_members(pgid), pgid)


def process_problem(proc: "ManagedProcess") -> str | None:
    """Why `proc` cannot serve (exited, stopped, zombie), or None if it is running."""
    rc = proc.returncode()
    if rc is not None:
        return _exit_text(rc)
    if proc.pid is None:
        return None
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    if state in ("T", "t"):
        return f"is stopped (pid {proc.pid} in state {state}: SIGSTOP or a debugger), so it cannot serve"
    if state == "Z":  # exiting: its leader is a zombie until its last thread is gone, then its exit code is read
        deadline = time.monotonic() + ZOMBIE_REAP_WAIT_S
        while (rc := proc.returncode()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return _exit_text(rc) if rc is not None else f"died (pid {proc.pid} is a zombie)"
    return None


def _exit_text(rc: int) -> str:
    sig = f" (killed by {signal.Signals(-rc).name})" if rc < 0 and -rc in signal.valid_signals() else ""
    return f"exited with code {rc}{sig}"


def process_group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes whose process group is `pgid` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            members.append(int(entry))
    return members


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
