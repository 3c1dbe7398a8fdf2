"""The engines: SGLang's servers behind sglang-router, or the embedded CPU engine. Any other `--sglang-<flag>`
and upstream's `--router-<flag>` are passed through (slime/arguments/pass_through.py)."""

from __future__ import annotations

import argparse
import os

from slime.arguments.base import Args, _require


def add(p: argparse.ArgumentParser, entry: str) -> None:
    g = p.add_argument_group("engines (any other --sglang-<flag> of SGLang's ServerArgs is passed to the servers, "
                             "and upstream's --router-<flag> to sglang-router as --<flag>; both checked at parse time)")
    g.add_argument("--rollout-backend", choices=["auto", "embedded", "sglang"], default="auto",
                   help="engines: real SGLang servers, or the embedded CPU engine (auto: sglang when CUDA and sglang are present)")
    g.add_argument("--embedded-engine-threads", type=int, default=1, help="torch threads of each embedded engine")
    g.add_argument("--sglang-python", type=str, default=os.environ.get("SLIME_SGLANG_PYTHON") or None,
                   help="the interpreter that runs `sglang.launch_server` (--rollout-backend sglang; default "
                        "$SLIME_SGLANG_PYTHON, else this one): on a CPU box, the venv `python tools/sglang_cpu_env.py "
                        "install` builds (scripts/quickstart.sh does it for --rollout-backend sglang)")
    g.add_argument("--engine-startup-timeout", type=float, default=None,
                   help="seconds to wait for an engine to be healthy (default 180 embedded, 900 SGLang)")
    g.add_argument("--sglang-router-ip", type=str, default=None, help="use this router instead of starting one")
    g.add_argument("--sglang-router-port", type=int, default=None)
    g.add_argument("--sglang-router-policy", "--router-policy", type=str, default="round_robin",
                   help="sglang-router's --policy (upstream's default: cache_aware)")
    g.add_argument("--sglang-router-log-level", "--router-log-level", type=str, default="warn")
    g.add_argument("--sglang-router-request-timeout-secs", type=int, default=None)
    g.add_argument("--sglang-server-concurrency", type=int, default=512, help="requests in flight per engine")


def check(a: Args, entry: str) -> None:
    _require(a.embedded_engine_threads > 0, "--embedded-engine-threads", "must be > 0")
    _require(a.sglang_server_concurrency > 0, "--sglang-server-concurrency", "must be > 0")
