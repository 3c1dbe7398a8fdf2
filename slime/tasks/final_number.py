"""The real-model quick start's reward (`--custom-rm-path slime.tasks.final_number.reward`): 1 when the response's
final number equals the label, else 0.

The final number: what the last `\\boxed{...}` holds when the response has one (the prompt asks for it), else the
last number written anywhere in the response (as lm-evaluation-harness's "flexible extract" reads GSM8K answers).
Numbers compare by value (`-28`, `-28.0` and `1,024` / `1024` match).

Why not `--rm-type math`: math-verify reads an unevaluated expression as its value, so a response that only
repeats the question (`8 - 2 =`) counts as the right answer 6. SmolLM2-135M-Instruct found that within five GRPO
steps on chain_sum: held-out accuracy 0.34 -> 0.98 with every answer an echo of its question (docs/real-model.md).
Here the echo's final number is the last operand (2), which is wrong.
"""

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
