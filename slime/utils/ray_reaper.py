"""Make the local Ray node's processes die with the driver, even a SIGKILLed one (Ray's agents otherwise wait ~60 s).

Run by file path as a watcher tied to the driver (PR_SET_PDEATHSIG); it imports nothing from slime."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def ray_processes_under(pid: int) -> list[tuple[int, float]]:
    """(pid, start time) of every descendant of `pid` that belongs to Ray (its servers, agents, workers)."""
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if "ray" in cmd and ("/ray/" in cmd or cmd.startswith("ray::")):
                out.append((p.pid, p.create_time()))
        except psutil.Error:
            continue
    return out


def start_reaper() -> subprocess.Popen | None:
    """Start the watcher for the Ray processes now under the driver; None if there are none (an attached cluster)."""
    driver_pid = os.getpid()
    targets = ray_processes_under(driver_pid)
    if not targets or not sys.platform.startswith("linux"):
        return None
    args = [sys.executable, os.path.abspath(__file__), str(driver_pid)] + [f"{p}:{t!r}" for p, t in targets]
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=_term_when_parent_dies, start_new_session=True)


def _term_when_parent_dies() -> None:  # in the child, between fork and exec
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _reap(targets: list[tuple[int, float]]) -> None:
    import psutil

    for pid, started in targets:
        try:
            p = psutil.Process(pid)
            if abs(p.create_time() - started) < 1e-3:
                p.kill()
        except psutil.Error:
            continue


def main(argv: list[str]) -> int:
    driver = int(argv[0])
    targets = [(int(p), float(t)) for p, t in (item.split(":", 1) for item in argv[1:])]
    done = False

    def on_term(*_):
        nonlocal done
        done = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the driver's to handle
    while not done and os.getppid() == driver:
        time.sleep(POLL_S)
    _reap(targets)  # the driver is gone (or exiting): its Ray processes go with it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
