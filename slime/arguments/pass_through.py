"""The command line's other options: `--sglang-<flag>` for SGLang's servers and upstream's `--router-<flag>` for
sglang-router, each checked against the real part's own flags (slime/utils/sglang_flags.py); anything else is
refused, naming the flag (upstream's flags we do not take: with what to use instead)."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from slime.arguments.base import ArgumentError
from slime.upstream_flags import refusal


def _option_chunks(unknown: list[str]) -> list[list[str]]:
    """The options argparse did not know, each with the values that follow it."""
    chunks: list[list[str]] = []
    for tok in unknown:
        if tok.startswith("--") or not chunks:
            chunks.append([tok])
        else:
            chunks[-1].append(tok)
    return chunks


def _split_pass_through(unknown: list[str], parser: argparse.ArgumentParser, rollout_backend: str
                        ) -> tuple[dict, tuple[str, ...]]:
    """The `--sglang-<flag>` and `--router-<flag>` options, each checked against the real part's own flags."""
    from slime.utils.sglang_flags import router_pass_through, unknown_flag_error

    ours = [o for a in parser._actions for o in a.option_strings]
    server = None
    if rollout_backend == "embedded":  # the embedded engine takes those of SGLang's flags it has, and its own
        from slime.backends.hf_engine.__main__ import build_parser as engine_parser

        server = (frozenset(o[2:] for a in engine_parser()._actions for o in a.option_strings if o.startswith("--")),
                  "the embedded engine (--rollout-backend embedded)")
    sglang: dict[str, Any] = {}
    router: list[str] = []
    for tok, *values in _option_chunks(unknown):
        flag, eq, value = tok.partition("=")
        instead = refusal(flag)
        if instead is not None:
            raise ArgumentError(f"{flag}: upstream slime's flag is not taken here: {instead}")
        if flag.startswith("--router-"):
            router += [tok, *values]
        elif flag.startswith("--sglang-") and len(flag) > len("--sglang-"):
            name = flag[len("--sglang-"):]
            error = unknown_flag_error(name, [o for o in ours if o.startswith("--sglang-")], server)
            if error is not None:
                raise ArgumentError(error)
            given = [value] if eq else values
            sglang[name] = True if not given else given[0] if len(given) == 1 else given
        else:
            close = difflib.get_close_matches(flag, ours, n=1, cutoff=0.8)
            raise ArgumentError(f"unrecognized argument: {tok}" + (f" (did you mean {close[0]}?)" if close else ""))
    try:
        return sglang, router_pass_through(router, [o for o in ours if o.startswith("--router-")])
    except ValueError as e:
        raise ArgumentError(str(e)) from None
