"""`--rm-type math`: HF math-verify (parse + symbolic verify), 1.0 if equivalent else 0.0.

math-verify's own timeouts use `signal.alarm`, which only works in the main
thread; we switch them off (`parsing_timeout=None`, `timeout_seconds=None`)
and run the check in a daemon thread under our own deadline instead
(`run_in_daemon_thread`).
"""

from __future__ import annotations

from slime.rollout.rm_hub.math_utils import labels_of
from slime.rollout.rm_hub.threads import run_in_daemon_thread


def _parse_gold(gold: str):
    from math_verify import parse

    # a bare expression such as `x^2+1` only parses inside math delimiters
    candidates = [gold] if ("$" in gold or "\\boxed" in gold) else [f"${gold}$", gold]
    for text in candidates:
        parsed = parse(text, parsing_timeout=None)
        if parsed:
            return parsed
    raise ValueError(f"math-verify cannot parse the label {gold[:120]!r}")


def math_verify_correct(response: str, label) -> bool:
    """Blocking: does the answer in `response` equal any gold answer in `label` (math-verify)?"""
    from math_verify import parse, verify

    golds = labels_of(label)
    if not golds:
        raise ValueError("math reward needs a label (set --label-key)")
    pred = parse(response, parsing_timeout=None)
    if not pred:
        return False
    return any(verify(_parse_gold(g), pred, timeout_seconds=None) for g in golds)


def math_verify_answer_correct(answer: str, label) -> bool:
    """Blocking: like `math_verify_correct` for an already extracted answer (`boxed_math`)."""
    if not answer.strip():
        return False
    return math_verify_correct(f"${answer}$", label)


async def math_verify_reward(response: str, label, timeout: float | None, answer_only: bool = False) -> float:
    """1.0 / 0.0 from math-verify, computed off the event loop within `timeout` seconds."""
    check = math_verify_answer_correct if answer_only else math_verify_correct
    return 1.0 if await run_in_daemon_thread(check, response, label, timeout=timeout) else 0.0
