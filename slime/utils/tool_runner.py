"""ToolRunner: runs tool calls in isolated worker processes, each call time-limited, its output bounded, never
twice (results are kept by call id, so a caller interrupted by an APRIL abort picks it up later). A tool's
misbehaviour is a `ToolResult` with `ok=False`, never an exception."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from slime.utils.tool_calls import ToolSpec

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 60.0
SCRATCH_PREFIX = "slime-tools-"
_KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ", "SYSTEMROOT")


def _remove_dead_scratch_dirs() -> None:
    """Scratch directories of runners whose process is gone (a run killed with -9 cannot remove its own)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(SCRATCH_PREFIX):
            continue
        pid = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str = ""
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False  # the output was cut at max_output_chars


class _Worker:
    """One worker process and its pipes; used by one thread at a time."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: str):
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True, close_fds=True)
        self._buf = b""
        self.isolation = "unknown"

    def read_line(self, deadline: float, max_bytes: int) -> bytes | str:
        """The next reply line, or a string saying why there is none (timeout, exit, over the bound)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait(timeout=5)
                return f"worker exited with code {code}"
            self._buf += chunk
            if len(self._buf) > max_bytes and b"\n" not in self._buf:
                return f"reply over {max_bytes} bytes"
        line, _, self._buf = self._buf.partition(b"\n")
        if len(line) > max_bytes:
            return f"reply over {max_bytes} bytes"
        return line

    def send(self, obj: dict) -> None:
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the tool's own children too
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("tool worker %d did not exit after SIGKILL", self.proc.pid)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class ToolRunner:
    def __init__(self, workers: int = 2, timeout_s: float = 10.0, max_output_chars: int = 1024, memory_mb: int = 2048,
                 keep_results: int = 4096):
        if workers < 1 or timeout_s <= 0 or max_output_chars < 1 or memory_mb < 0 or keep_results < 1:
            raise ValueError(f"ToolRunner: need workers >= 1, timeout_s > 0, max_output_chars >= 1, memory_mb >= 0, "
                             f"keep_results >= 1 (got {workers}, {timeout_s}, {max_output_chars}, {memory_mb}, "
                             f"{keep_results})")
        self.timeout_s, self.max_output_chars, self.memory_mb = float(timeout_s), int(max_output_chars), int(memory_mb)
        self.keep_results = keep_results
        # a reply is JSON: each character at most 6 bytes (an escape), plus the fields around it
        self.max_reply_bytes = 6 * self.max_output_chars + 4096
        _remove_dead_scratch_dirs()
        # the workers' working and home directory (named by pid: a killed run's is removed by the next runner)
        self.scratch_dir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
        self._env = {k: os.environ[k] for k in _KEPT_ENV if k in os.environ}
        self._env.update(HOME=self.scratch_dir, SLIME_TOOL_PARENT=str(os.getpid()), PYTHONPATH=os.pathsep.join(os.path.abspath(p or ".") for p in sys.path),
                         PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
        self._cmd = [sys.executable, "-m", "slime.utils.tool_worker", "--max-output-chars", str(self.max_output_chars),
                     "--memory-mb", str(self.memory_mb)]
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool-call")
        self._lock = threading.Lock()
        self._calls: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._live: set[_Worker] = set()
        self.isolation = "not started"
        self.closed = False
        self.counts = {"calls": 0, "failures": 0, "timeouts": 0, "workers_killed": 0}

    # ---- calls ------------------------------------------------------------------------
    def submit(self, call_id: str, spec: ToolSpec, arguments) -> concurrent.futures.Future:
        """Run `spec` on `arguments` once for `call_id`; a known id gets its existing future back."""
        with self._lock:
            if self.closed:
                raise RuntimeError("ToolRunner is closed")
            fut = self._calls.get(call_id)
            if fut is not None and not fut.cancelled():  # a cancelled call never started: it may be sent again
                return fut
            timeout = float(spec.timeout_s or self.timeout_s)
            fut = self._pool.submit(self._run, spec.function, arguments, timeout)
            self._calls[call_id] = fut
            while len(self._calls) > self.keep_results:
                old_id, old = next(iter(self._calls.items()))
                if not old.done():
                    break
                del self._calls[old_id]
            return fut

    def lookup(self, call_id: str) -> concurrent.futures.Future | None:
        """The call's future if this runner ran (or runs) it and still keeps its result."""
        with self._lock:
            return self._calls.get(call_id)

    def forget(self, call_id: str) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def _run(self, function: str, arguments, timeout: float) -> ToolResult:
        worker = self._idle.get()
        t0 = time.monotonic()
        try:
            if worker is None or worker.proc.poll() is not None:
                worker = self._start_worker(worker)
            worker.send({"function": function, "arguments": arguments})
            line = worker.read_line(t0 + timeout, self.max_reply_bytes)
            seconds = time.monotonic() - t0
            if isinstance(line, str):  # no reply: the worker is not reusable
                worker.kill()
                self._forget_worker(worker)
                worker = None
                error = f"timed out after {timeout:g}s" if line == "timeout" else line
                return self._count(ToolResult(False, error=error, seconds=seconds), timeout=line == "timeout")
            try:
                reply = json.loads(line)
            except ValueError:
                worker.kill()
                self._forget_worker(worker)
                worker = None
                return self._count(ToolResult(False, error="unreadable reply from the worker", seconds=seconds))
            if reply.get("ok"):
                return self._count(ToolResult(True, output=reply["output"], seconds=seconds,
                                              truncated=bool(reply.get("truncated"))))
            return self._count(ToolResult(False, error=str(reply.get("error")), seconds=seconds))
        except (OSError, ValueError) as e:  # broken pipe to a dead worker, a start that failed
            if worker is not None:
                worker.kill()
                self._forget_worker(worker)
            worker = None
            return self._count(ToolResult(False, error=f"tool worker failed: {type(e).__name__}: {e}",
                                          seconds=time.monotonic() - t0))
        finally:
            self._idle.put(worker)

    def _count(self, result: ToolResult, timeout: bool = False) -> ToolResult:
        with self._lock:
            self.counts["calls"] += 1
            self.counts["failures"] += 0 if result.ok else 1
            self.counts["timeouts"] += int(timeout)
        return result

    # ---- workers ----------------------------------------------------------------------
    def _start_worker(self, old: _Worker | None) -> _Worker:
        if old is not None:
            old.kill()
            self._forget_worker(old)
        worker = _Worker(self._cmd, self._env, self.scratch_dir)
        with self._lock:  # registered before close() can miss it: a worker started while closing is killed here
            self._live.add(worker)
            closed = self.closed
        if closed:
            worker.kill()
            raise OSError("ToolRunner is closed")
        hello = worker.read_line(time.monotonic() + WORKER_START_TIMEOUT_S, 4096)
        if isinstance(hello, str):
            worker.kill()
            self._forget_worker(worker)
            raise OSError(f"tool worker did not start: {hello}")
        self.isolation = json.loads(hello).get("isolation", "unknown")
        worker.isolation = self.isolation
        return worker

    def _forget_worker(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._live:
                self._live.discard(worker)
                self.counts["workers_killed"] += 1

    def close(self) -> None:
        """Kill every worker (a call still running gets `tool worker failed`) and remove the scratch directory."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            live = list(self._live)
        for w in live:
            w.kill()
        self._pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
