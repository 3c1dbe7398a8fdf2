"""Answer extraction shared by the rule-based rewards: the last boxed answer, EOS texts, labels (linear time)."""

from __future__ import annotations

import re

THINK_END = "</think>"
_BOXED_COMMANDS = ("\\boxed", "\\fbox")
# `Answer: 42`, `**Final answer:** 42`, `The answer is 42.`: the rest of that line
_ANSWER_STATEMENT = re.compile(r"(?i)answer(?:\s*\**\s*:|\s+is\b:?)\s*\**\s*([^\n]+)")
# special-token texts a response may end with when decoded with `skip_special_tokens: false`
# (Qwen, Llama 3, Llama 2 / Mistral, DeepSeek)
EOS_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<｜end▁of▁sentence｜>")


def strip_eos_text(text: str) -> str:
    """`text` without the special-token texts (and whitespace) it ends with."""
    end = len(text)
    while True:
        stripped = text[:end].rstrip()
        for eos in EOS_TEXTS:
            if stripped.endswith(eos):
                end = len(stripped) - len(eos)
                break
        else:
            return stripped if end < len(text) else text


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed x`) in `text`, braces balanced, or None."""
    if not isinstance(text, str):
        return None
    start = max(text.rfind(cmd) for cmd in _BOXED_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOXED_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if i < len(text) and text[i] == " ":
        # `\boxed 5`: the argument runs to the next `$` or end of line / text
        rest = text[i + 1 :]
        end = min((p for p in (rest.find("$"), rest.find("\n")) if p >= 0), default=len(rest))
        return text[start : i + 1 + end].rstrip()
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start : j + 1]
    return None  # unbalanced: the model stopped mid-answer


def remove_boxed(boxed: str) -> str:
    """`\\boxed{x}` -> `x`, `\\boxed x` -> `x`; raises ValueError on anything else."""
    for cmd in _BOXED_COMMANDS:
        if boxed.startswith(cmd + "{") and boxed.endswith("}"):
            return boxed[len(cmd) + 1 : -1]
        if boxed.startswith(cmd + " "):
            return boxed[len(cmd) + 1 :].strip()
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def extract_boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text` (nested braces kept), or None."""
    boxed = last_boxed_only_string(text)
    return None if boxed is None else remove_boxed(boxed)


def final_answer_statement(text: str) -> str | None:
    """The answer on the last `Answer: ...` / `the answer is ...` line of `text` (cleaned), or None."""
    matches = _ANSWER_STATEMENT.findall(text)
    if not matches:
        return None
    answer = matches[-1].strip().rstrip(".").strip()
    if answer.startswith("$") and answer.endswith("$"):
        answer = answer.strip("$")
    return answer or None


def labels_of(label) -> list[str]:
    """A label as a list of acceptable answers (strings); a boxed label is unboxed."""
    items = label if isinstance(label, (list, tuple)) else [label]
    out = []
    for item in items:
        if item is None:
            continue
        s = str(item)
        unboxed = extract_boxed_answer(s) if "\\boxed" in s or "\\fbox" in s else None
        out.append(unboxed if unboxed is not None else s)
    return out


def extract_answer(passage: str) -> str | None:
    """Upstream slime's name: the content of the last `\\boxed{...}` in `passage`, or None."""
    return extract_boxed_answer(passage)

