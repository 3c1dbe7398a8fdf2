"""Is a final answer right? Normalise both to a canonical string and compare; only when the strings differ,
compare structure and values (`math_expr`, `math_value`: bounded). Normalisation drops what upstream's DeepScaleR
grader drops (wrappers, units, `\\text{}`, choice letters, mixed numbers) and a few more decorations."""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_expr import read
from slime.rollout.rm_hub.math_value import same_value
from slime.rollout.rm_hub.math_utils import strip_eos_text

MAX_ANSWER_CHARS = 1000  # longer "answers" are compared as raw strings only

_UNICODE = (("−", "-"), ("π", "\\pi"), ("√", "\\sqrt"), ("·", "\\cdot"), ("×", "\\times"), ("∞", "\\infty"),
            ("°", ""), ("\u2009", ""), ("\u00a0", " "), ("，", ","))
_DROPPED = ("\\displaystyle", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\ ", "^{\\circ}", "^\\circ",
            "\\%", "\\$")
_RENAMED = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"), ("\\dbinom", "\\binom"),
            ("\\tbinom", "\\binom"), ("\\mbox{", "\\text{"), ("\\textrm{", "\\text{"), ("\\textnormal{", "\\text{"),
            ("\\mathrm{", "\\text{"))
_UNWRAPPED = ("\\text", "\\textbf", "\\textit", "\\mathbf", "\\mathit", "\\boldsymbol", "\\emph", "\\underline",
              "\\boxed", "\\fbox")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])\.?")
_UNIT_WORDS = (
    "degree|cm|centimeter|centimetre|mm|millimeter|km|kilometer|meter|metre|mile|inch|inche|foot|feet|ft|yard|yd|"
    "second|sec|minute|min|hour|hr|day|week|month|year|dollar|cent|unit|mph|kg|gram|pound|lb|ounce|oz|liter|litre|"
    "ml|gallon|people|person|student|way|point|digit|integer|number|time|percent"
)
_TRAILING_TEXT_UNIT = re.compile(r"^(.*?[\w})\]])\s*\\text\{\s*[a-zA-Z][a-zA-Z .'/-]*\}(?:\^\{?[23]\}?)?\.?$")
_TRAILING_WORD_UNIT = re.compile(
    r"^(.*?(?:[\d})\]]|\\[a-zA-Z]+))\s*(?:(?:square|sq\.?|cubic)\s*)?(?:" + _UNIT_WORDS + r")(?:es|s)?(?:\^\{?[23]\}?)?\.?$")
_SCALE_WORD = re.compile(r"^(.*?\d)\s*(million|billion|trillion)$")
_SCALES = {"million": "10^{6}", "billion": "10^{9}", "trillion": "10^{12}"}
_PLAIN_MIXED = re.compile(r"(?<![\w.^_}{])(\d+)\s+(\d+)/(\d+)(?![\w.])")
_LATEX_MIXED = re.compile(r"(?<![\w.^_}{)])(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_FRAC_SHORT = re.compile(r"\\frac(?:(\d)(\d)|(\d)\{|\{([^{}]*)\}(\d))")
_SQRT_SHORT = re.compile(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))")
# `x`, `x_1`, `\\theta`, `f(x)`, `(x,y)`, two letters (upstream: any left-hand side of <= 2 characters)
_SHORT_LHS = re.compile(r"^(?:[a-zA-Z](?:_\{?\w+\}?)?|\\[a-zA-Z]+|[a-zA-Z]\([a-zA-Z]\)|\([a-zA-Z](?:,[a-zA-Z])+\)|[a-zA-Z]{2})$")
_RELATION = re.compile(r"=|\\in(?![a-zA-Z])")
_COMMA_NUMBER = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_DECIMAL = re.compile(r"^-?\d*\.\d+$")
_ENDS_WITH_COMMAND = re.compile(r"\\[a-zA-Z]+$")
_CHOICE = re.compile(r"^\(?([A-Z])\)?$|^\(([a-z])\)$")  # `B`, `(B)`; `(b)` too (upstream ignores case)
_WORD = re.compile(r"^[a-zA-Z]+(?: [a-zA-Z]+)*$")


def _unwrap_command(s: str, command: str) -> str:
    """Replace every `\\command{X}` by `X` (balanced braces)."""
    key = command + "{"
    start = s.find(key)
    while start >= 0:
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
        start = s.find(key, start)
    return s


def _strip_outer_braces(s: str) -> str:
    """`{{42}}` -> `42`: every brace pair that encloses the whole string (one pass)."""
    if not (s.startswith("{") and s.endswith("}")):
        return s
    match, stack = {}, []
    for k, ch in enumerate(s):
        if ch == "{":
            stack.append(k)
        elif ch == "}" and stack:
            match[stack.pop()] = k
    i, n = 0, len(s)
    while i < n - 1 - i and s[i] == "{" and match.get(i) == n - 1 - i:
        i += 1
    return s[i : n - i]


def _fix_frac(m: re.Match) -> str:
    a, b, c, num, d = m.groups()
    if a is not None:
        return f"\\frac{{{a}}}{{{b}}}"
    if c is not None:
        return f"\\frac{{{c}}}{{"
    return f"\\frac{{{num}}}{{{d}}}"


def _remove_spaces(s: str) -> str:
    """All whitespace removed, except one space that ends a command before a letter (`\\cdot e`)."""
    pieces = s.split()
    if len(pieces) <= 1:
        return pieces[0] if pieces else ""
    out = [pieces[0]]
    for piece in pieces[1:]:
        if piece[0].isalpha() and _ENDS_WITH_COMMAND.search(out[-1]):
            out.append(" ")
        out.append(piece)
    return "".join(out)


def _strip_units(s: str) -> str:
    for _ in range(2):  # `5\text{ cm}^2`, `12 square units`
        m = _TRAILING_TEXT_UNIT.match(s) or _TRAILING_WORD_UNIT.match(s)
        if m is None:
            break
        s = m.group(1)
    m = _SCALE_WORD.match(s)
    if m is not None:
        s = f"{m.group(1)}\\cdot{_SCALES[m.group(2)]}"
    return s


def normalize_answer(answer) -> str:
    """A canonical string for a final answer (see the module docstring for what it removes)."""
    s = strip_eos_text(str(answer)).strip()
    if len(s) > MAX_ANSWER_CHARS:
        return s
    if not s.isascii():
        for before, after in _UNICODE:
            s = s.replace(before, after)
    if "\\" in s:
        for tok in _DROPPED:
            s = s.replace(tok, "")
        for before, after in _RENAMED:
            s = s.replace(before, after)
        s = _LEFT_RIGHT.sub("", s)
    s = s.replace("{,}", "").replace("%", "").replace("$", "").replace("~", " ").strip()
    s = _strip_units(s)
    if "\\" in s:
        unwrapped = s
        for cmd in _UNWRAPPED:
            if cmd + "{" in unwrapped:
                unwrapped = _unwrap_command(unwrapped, cmd)
        if unwrapped != s:  # `\\text{45 degrees}`: the unit was inside
            s = _strip_units(unwrapped.strip())
    if "/" in s:
        s = _PLAIN_MIXED.sub(r"(\1+\2/\3)", s)
    s = _remove_spaces(s)
    s = _strip_outer_braces(_element(_strip_outer_braces(s)))
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    if "\\frac" in s:
        s = _FRAC_SHORT.sub(_fix_frac, s)
        s = _LATEX_MIXED.sub(r"(\1+\\frac{\2}{\3})", s)
    if "\\sqrt" in s:
        s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = s.rstrip(".") if not s.endswith("..") else s
    if "," in s and _COMMA_NUMBER.match(s):
        s = s.replace(",", "")
    if "." in s and _DECIMAL.match(s):
        sign, s = ("-", s[1:]) if s.startswith("-") else ("", s)
        s = s.rstrip("0").rstrip(".")
        s = sign + ("0" + s if s.startswith(".") else s or "0")
        if s == "-0":
            s = "0"
    m = _CHOICE.match(s)
    if m is not None:
        s = (m.group(1) or m.group(2)).upper()
    return s


# ------------------------------------------------------------- structure ----
def _split_top(s: str) -> list[str]:
    """`s` split at commas outside brackets/braces."""
    parts, depth, start = [], 0, 0
    for k, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:k])
            start = k + 1
    parts.append(s[start:])
    return parts


def _one_group(s: str) -> bool:
    """The first opening bracket of `s` closes at its last character (brackets of any kind: intervals)."""
    depth = 0
    for k, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return k == len(s) - 1
    return False


def structure(s: str) -> tuple[str, list[str]]:
    """(kind, elements): kind is `set` (`\\{...\\}`), the bracket pair of a tuple or interval (`()`, `[)`...),
    `list` for a bare comma list, or `atom` for a single answer."""
    if s.startswith("\\{") and s.endswith("\\}") and "," in s:
        return "set", _split_top(s[2:-2])
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and _one_group(s):
        parts = _split_top(s[1:-1])
        if len(parts) > 1:
            return s[0] + s[-1], parts
    if "," in s:
        parts = _split_top(s)
        if len(parts) > 1:
            return "list", parts
    return "atom", [s]


def _element(s: str) -> str:
    """`s` without a short left-hand side (`x=5`, `x\\in[1,2]`); elements of `x=1,y=2` each carry their own."""
    parts = _RELATION.split(s)
    if len(parts) == 2 and parts[1] and _SHORT_LHS.match(parts[0]):
        return parts[1]
    return s


def is_word(normalized: str) -> bool:
    """A text answer (letters and spaces only): compared as a word, never as a product of variables."""
    return bool(_WORD.match(normalized))


def _elements_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    if not a or not b:
        return False
    if _WORD.match(a) and _WORD.match(b):  # words are never products of variables (`no` vs `on`)
        return a.casefold() == b.casefold()
    ea, eb = read(a), read(b)
    return ea is not None and eb is not None and same_value(ea, eb) is True


def _unordered_equal(xs: list[str], ys: list[str]) -> bool:
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:
        k = next((k for k, y in enumerate(left) if _elements_equal(x, y)), None)
        if k is None:
            return False
        left.pop(k)
    return True


def normalized_match(a: str, b: str) -> bool:
    """`answers_match` for answers already passed through `normalize_answer`."""
    if not a or not b:
        return False
    if a == b or a.casefold() == b.casefold():  # upstream's grader ignores case
        return True
    if len(a) > MAX_ANSWER_CHARS or len(b) > MAX_ANSWER_CHARS:
        return False
    (kind_a, xs), (kind_b, ys) = structure(a), structure(b)
    if kind_a == "atom" and kind_b == "atom":
        return _elements_equal(a, b)
    xs, ys = [_element(x) for x in xs], [_element(y) for y in ys]
    if {kind_a, kind_b} <= {"set", "list"}:
        return _unordered_equal(xs, ys) if "set" in (kind_a, kind_b) else xs == ys or (
            len(xs) == len(ys) and all(_elements_equal(x, y) for x, y in zip(xs, ys)))
    if kind_a != kind_b or len(xs) != len(ys):
        return False
    return all(_elements_equal(x, y) for x, y in zip(xs, ys))


def answers_match(pred: str, gold: str) -> bool:
    """Is `pred` the same answer as `gold`? Cheap string match first, then structure and value."""
    return normalized_match(normalize_answer(pred), normalize_answer(gold))


def definitely_different(a: str, b: str) -> bool:
    """Normalised answers that are both plain arithmetic (`math_expr.Expression.plain`) with different values
    (a decimal approximation of an irrational value counts as different): wrong for any reader."""
    ea, eb = read(a), read(b)
    if ea is None or eb is None or not (ea.plain and eb.plain):
        return False
    return same_value(ea, eb) is False
