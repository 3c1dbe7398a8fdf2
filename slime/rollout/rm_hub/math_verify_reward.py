"""`--rm-type math`: 1.0 if the final answer (after `</think>`: boxed, stated, or math-verify's) equals a gold
answer. `math_grader` decides first; undecided answers go to math-verify in a daemon thread under
`--reward-timeout`. A decimal approximation is right only when the label has a decimal."""

from __future__ import annotations

import logging
import re

from slime.rollout.rm_hub.math_grader import answers_match, definitely_different, is_word, normalize_answer, normalized_match
from slime.rollout.rm_hub.math_utils import (
    THINK_END,
    extract_boxed_answer,
    final_answer_statement,
    labels_of,
    strip_eos_text,
)
from slime.rollout.rm_hub.threads import run_in_daemon_thread

_APPROXIMATE_DECIMAL = re.compile(r"\d*\.\d*[1-9]")  # 0.33, 6.2831 (not 2.0)


_BOUNDED_THREAD = "rm-check-math-verify-bounded"  # the thread of a check under a time limit


class _BoundedHere(logging.Filter):
    """Drops math-verify's "timeouts are off" warning where it is untrue (our bounded threads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _BOUNDED_THREAD or "Timeout is disabled" not in record.getMessage()


for _logger in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger).addFilter(_BoundedHere())


def golds_of(label) -> list[str]:
    golds = [g for g in labels_of(label) if g.strip()]
    if not golds:
        raise ValueError("math reward needs a label (set --label-key)")
    return golds


def quick_verdict(answer: str, golds: list[str]) -> bool | None:
    """Decide on the cheap path when we can: True (matches a gold), False (different exact numbers), None (ask math-verify)."""
    pred = normalize_answer(answer)
    if not pred:
        return False
    normalized = [normalize_answer(g) for g in golds]
    if any(normalized_match(pred, g) for g in normalized):
        return True
    if is_word(pred) and all(is_word(g) for g in normalized):
        return False  # text answers (`yes`, `no`, `B`): math-verify would read `no` = `on` as products
    if "%" in answer or any("%" in g or _APPROXIMATE_DECIMAL.search(g) for g in golds):
        return None  # math-verify reads percentages and compares to a decimal label with tolerance
    if all(definitely_different(pred, g) for g in normalized):
        return False
    return None


def _parse_gold(gold: str):
    from math_verify import parse

    # a bare expression such as `x^2+1` only parses inside math delimiters
    candidates = [gold] if "\\boxed" in gold else [f"${gold}$", "\\boxed{" + gold + "}", gold]
    for text in candidates:
        parsed = parse(text, parsing_timeout=None)
        if parsed:
            return parsed
    return None


def _is_approximation(pred_text: str, gold: str) -> bool:
    return bool(_APPROXIMATE_DECIMAL.search(pred_text)) and not _APPROXIMATE_DECIMAL.search(gold)


def math_verify_correct(text: str, golds: list[str]) -> bool:
    """Blocking (math-verify): does the answer in `text` equal any gold answer?"""
    from math_verify import parse, verify

    pred = parse(text, parsing_timeout=None)
    if not pred:
        return False
    pred_text = pred[-1] if isinstance(pred[-1], str) else text
    for gold in golds:
        parsed = _parse_gold(gold)
        if parsed is None:  # unreadable label: the normalised-string match decides
            if answers_match(pred_text, gold):
                return True
            continue
        if verify(parsed, pred, timeout_seconds=None):
            if _is_approximation(pred_text, gold) and not answers_match(pred_text, gold):
                continue
            return True
    return False


async def math_verify_reward(response: str, label, timeout: float | None, answer_only: bool = False) -> float:
    """1.0 / 0.0: the cheap verdict when there is one, else math-verify off the event loop within `timeout` seconds."""
    golds = golds_of(label)
    if answer_only:
        answer, text = response, "\\boxed{" + response + "}"
    else:
        text = strip_eos_text(response)
        if THINK_END in text:
            text = text.split(THINK_END, 1)[1]
        answer = extract_boxed_answer(text)
        if answer is not None:
            text = "\\boxed{" + answer + "}"
        else:
            answer = final_answer_statement(text)
    if answer is not None:
        if not answer.strip():
            return 0.0
        verdict = quick_verdict(answer, golds)
        if verdict is not None:
            return 1.0 if verdict else 0.0
    return 1.0 if await run_in_daemon_thread(math_verify_correct, text, golds, timeout=timeout,
                                             name=_BOUNDED_THREAD if timeout is not None else None) else 0.0
