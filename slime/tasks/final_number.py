"""The real-model quick start's reward: 1 when the response's final number (last `\\boxed{}`, else last number)
equals the label, else 0. Not `--rm-type math`, which reads an echoed question (`8 - 2 =`) as its value."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(response: str) -> Decimal | None:
    """The response's final number (see the module's docstring), or None when it writes none."""
    boxed = _BOXED.findall(response or "")
    numbers = _NUMBER.findall(boxed[-1] if boxed else response or "")
    if not numbers:
        return None
    return _value(numbers[-1])


def _value(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").strip())
    except InvalidOperation:
        return None


def compute_reward(response: str, label) -> float:
    gold = _value(str(label))
    if gold is None:
        raise ValueError(f"final_number reward: the label {label!r} is not a number")
    got = final_number(response)
    return 1.0 if got is not None and got == gold else 0.0


async def reward(args, sample) -> float:
    """`--custom-rm-path slime.tasks.final_number.reward`."""
    return compute_reward(sample.response, sample.label)
