"""Answer extraction and normalisation shared by the rule-based rewards.

Pure string functions: no sympy, no timeouts needed (everything here is
linear in the length of the answer).
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


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


def _unwrap_command(s: str, command: str) -> str:
    """Replace every `\\command{X}` by `X` (balanced braces)."""
    key = command + "{"
    while True:
        start = s.find(key)
        if start < 0:
            return s
        depth, j = 0, start + len(command)
        for j in range(start + len(command), len(s)):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    break
        else:
            return s  # unbalanced; leave as is
        s = s[:start] + s[start + len(key) : j] + s[j + 1 :]


_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%", "\\displaystyle")
_NUMBER_WITH_COMMAS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")


def normalize_answer(answer: str) -> str:
    """A canonical string for a final answer (units/wrappers/spacing dropped, fractions in `\\frac{a}{b}` form)."""
    s = str(answer).strip()
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\mbox"):
        s = _unwrap_command(s, cmd)
    for tok in _DROP:
        s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s)
    # `x=5`, `k = 3`: keep the right-hand side of a short left-hand side
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs) <= 2:
            s = rhs
    # `\frac12` -> `\frac{1}{2}`, `\frac1{2}` -> `\frac{1}{2}`, `\sqrt2` -> `\sqrt{2}`
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.rstrip(".")
    if _NUMBER_WITH_COMMAS.match(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    if s.startswith("-."):
        s = "-0" + s[1:]
    return s


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+)/(-?\d+)$")
_DECIMAL = re.compile(r"^-?\d+(\.\d+)?$")


def to_number(normalized: str) -> Fraction | None:
    """Exact value of an integer, decimal, `a/b` or `\\frac{a}{b}` answer (already normalised), else None."""
    try:
        if _DECIMAL.match(normalized):
            return Fraction(normalized)
        m = _SLASH.match(normalized)
        if m:
            return Fraction(int(m.group(1)), int(m.group(2)))
        m = _FRAC.match(normalized)
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
    except ZeroDivisionError:
        return None
    return None


def answers_match(pred: str, gold: str) -> bool:
    """Equal after normalisation, or the same exact number (`0.5` == `\\frac{1}{2}` == `1/2`)."""
    a, b = normalize_answer(pred), normalize_answer(gold)
    if not a or not b:
        return False
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and x == y


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
