"""The flags passed through to SGLang's server (`--sglang-<flag>`) and to sglang-router (`--router-<flag>`),
checked against their own flag names at parse time so that a typo fails at once. The driver never imports SGLang:
an unshipped version's names are read from its code in a child process."""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from typing import Iterable

from slime.utils.sglang_server_flags import FLAGS
from slime.utils.sglang_versions import SGLANG_PINNED

_READ = """
import argparse, json
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser(add_help=False)
ServerArgs.add_cli_args(p)
print(json.dumps(sorted({o[2:] for a in p._actions for o in a.option_strings if o.startswith("--")})))
"""


def read_server_flags(python_path: list[str] | None = None, prelude: str = "", timeout: float = 600.0) -> set[str]:
    """The flag names of the SGLang importable with `python_path` first on sys.path, from its own
    `ServerArgs.add_cli_args` in a child process (`prelude` runs first there)."""
    env = dict(os.environ)
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join([*python_path, *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-c", prelude + "\n" + _READ], capture_output=True, text=True, env=env,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"reading SGLang's ServerArgs flags failed:\n{proc.stderr[-2000:]}")
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def installed_sglang_version() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)  # the installed SGLang does not change while a process runs
def server_flags() -> tuple[frozenset[str], str]:
    """(SGLang's flag names without --, which SGLang they are from)."""
    version = installed_sglang_version()
    if version is None:
        return FLAGS[SGLANG_PINNED], f"SGLang {SGLANG_PINNED} (not installed here; its flags as this project ships them)"
    if version in FLAGS:
        return FLAGS[version], f"the installed SGLang {version}"
    return frozenset(read_server_flags()), f"the installed SGLang {version}"


def unknown_flag_error(name: str, own_flags: Iterable[str] = (), server: tuple[frozenset[str], str] | None = None
                       ) -> str | None:
    """None when `--sglang-<name>` reaches a real server flag (`server`: (names, whose); default SGLang's); else the
    error, naming the closest real flag (the server's, or one of `own_flags`: this project's own --sglang-* flags)."""
    name = name.replace("_", "-")
    known, source = server or server_flags()
    if name in known:
        return None
    candidates = sorted({f"--sglang-{k}" for k in known} | set(own_flags))
    close = difflib.get_close_matches(f"--sglang-{name}", candidates, n=1, cutoff=0.75)
    hint = f"did you mean {close[0]}?" if close else "see `python -m sglang.launch_server --help` for its flags"
    return f"--sglang-{name}: {source} has no server flag --{name}; {hint}"


# upstream's --router-<flag> names a run here does not pass on, with why; the rest reach the launcher as --<flag>
_PD = "prefill/decode disaggregation is not supported: engines are regular SGLang servers"
_WORKERS = "the run registers its own engines with the router"
_BREAKER = ("the router's circuit breaker is off in every run (one batch of bad requests would otherwise stall the "
            "rollout for 60 s; slime/backends/sglang_utils/router.py)")
ROUTER_FLAGS_SET_HERE = {
    "router-pd-disaggregation": _PD, "router-prefill": _PD, "router-decode": _PD, "router-prefill-policy": _PD,
    "router-decode-policy": _PD, "router-prefill-selector": _PD, "router-decode-selector": _PD, "router-mini-lb": _PD,
    "router-service-discovery": _WORKERS, "router-service-discovery-port": _WORKERS,
    "router-service-discovery-namespace": _WORKERS, "router-selector": _WORKERS,
    "router-prometheus-port": "the run picks a free port for the router's metrics",
    "router-prometheus-host": "the router's metrics listen where the router does (--sglang-router-ip / --listen-host)",
    "router-disable-circuit-breaker": _BREAKER, "router-cb-failure-threshold": _BREAKER,
    "router-cb-success-threshold": _BREAKER, "router-cb-timeout-duration-secs": _BREAKER,
    "router-cb-window-duration-secs": _BREAKER,
    "router-request-timeout-secs": "use --sglang-router-request-timeout-secs (upstream too sets the router's request "
                                   "timeout from it and drops this one)",
}


class _RouterParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def router_pass_through(tokens: list[str], own_flags: Iterable[str] = ()) -> tuple[str, ...]:
    """Upstream's `--router-<flag>` options, checked by sglang-router's own parser; ValueError names the flag."""
    from sglang_router.router_args import RouterArgs

    p = _RouterParser(add_help=False, allow_abbrev=False)
    RouterArgs.add_cli_args(p, use_router_prefix=True, exclude_host_port=True)
    known = [o for a in p._actions for o in a.option_strings if o.startswith("--router-")]
    for tok in tokens:
        if not tok.startswith("--"):
            continue
        flag = tok.split("=", 1)[0]
        if flag[2:] in ROUTER_FLAGS_SET_HERE:
            raise ValueError(f"{flag}: not passed to sglang-router here: {ROUTER_FLAGS_SET_HERE[flag[2:]]}")
        if flag not in known:
            close = difflib.get_close_matches(flag, [*known, *own_flags], n=1, cutoff=0.75)
            raise ValueError(f"{flag}: sglang-router has no such flag"
                             + (f"; did you mean {close[0]}?" if close else " (python -m sglang_router.launch_router "
                                                                            "--help lists them without the router- prefix)"))
    try:
        p.parse_args(tokens)
    except ValueError as e:
        raise ValueError(f"sglang-router's flags: {e}") from None
    return tuple("--" + t[len("--router-"):] if t.startswith("--router-") else t for t in tokens)
