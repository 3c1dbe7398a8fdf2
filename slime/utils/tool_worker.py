"""A tool worker process for `ToolRunner`: one JSON call per stdin line, one JSON reply line on stdout.

Before any tool is imported it is sandboxed: dies with its parent, own session and scratch dir, no trainer
environment, an address-space limit, no network."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
import traceback

_PR_SET_PDEATHSIG = 1
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_REFUSED_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
                             "socket.gethostbyname", "socket.gethostbyaddr"})


def _die_with_parent() -> None:
    """SIGKILL this worker when the process that started it dies (kill -9 of the driver leaves no worker behind)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(os.environ.pop("SLIME_TOOL_PARENT", os.getppid())):
        os._exit(1)  # the parent died before the line above took effect


def _own_network_namespace() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0
    except (OSError, AttributeError):
        return False


def _refuse_network(event: str, _args) -> None:
    if event in _REFUSED_EVENTS:
        raise PermissionError(f"tool workers have no network ({event} refused)")


def isolate(memory_mb: int) -> str:
    """Cut this process off the network (and cap its memory); returns how ("netns+audit" or "audit")."""
    how = "netns+audit" if _own_network_namespace() else "audit"
    sys.addaudithook(_refuse_network)
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return how


def _describe(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"raised {type(e).__name__}: {e}{where}"


def run_one(functions: dict, request: dict, max_chars: int) -> dict:
    from slime.utils.misc import load_function

    t0 = time.perf_counter()
    try:
        path = request["function"]
        fn = functions.get(path)
        if fn is None:
            fn = functions[path] = load_function(path)
        out = fn(request.get("arguments"))
    except Exception as e:
        return {"ok": False, "error": _describe(e), "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    if not isinstance(out, str):
        return {"ok": False, "error": f"returned {type(out).__name__}, not str", "seconds": seconds}
    truncated = len(out) > max_chars
    out = out[:max_chars]
    try:
        out.encode("utf-8")
    except UnicodeEncodeError as e:
        return {"ok": False, "error": f"returned text that is not valid Unicode ({e.reason})", "seconds": seconds}
    return {"ok": True, "output": out, "truncated": truncated, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max-output-chars", type=int, required=True)
    p.add_argument("--memory-mb", type=int, default=0)
    a = p.parse_args(argv)
    _die_with_parent()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # a tool's prints (and a C library's writes to fd 1) go to stderr, never into the replies
    sys.stdout = sys.stderr
    how = isolate(a.memory_mb)
    replies.write(json.dumps({"ready": True, "isolation": how}) + "\n")
    functions: dict = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = run_one(functions, json.loads(line), a.max_output_chars)
        replies.write(json.dumps(reply, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
