"""DAPO's math reward (as in DAPO / verl `math_dapo`): +1 for a right `Answer:` line, -1 otherwise.

As DAPO: the last 300 characters, the text after the last `Answer:`, Minerva-style normalisation, equal strings.
Unlike upstream, unambiguous decorations are dropped too (`42.0` = `42`; commas only as thousands separators)."""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_utils import EOS_TEXTS, extract_boxed_answer, strip_eos_text

TAIL_CHARS = 300
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*(?:\*\*)?\s*:\s*([^\n]+)")  # DAPO's, plus `**Answer**:`
INVALID = "[INVALID]"

# (before, after) substitutions, then whole expressions deleted (units, filler words, spacing macros)
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "days", "years", "seconds", "weeks", "months",  # ours
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots", *EOS_TEXTS,
)
# ours (see the module docstring): removed after the Minerva steps
_DECORATIONS = ("**", "\\left", "\\right", "\\%", "%", "\\,", "\\!", "\\displaystyle", "\\(", "\\)")
_INTEGER_VALUED = re.compile(r"^([+-]?\d+)\.0*$")
_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")
_THOUSANDS = re.compile(r"^\d{1,3}(,\d{3})+$")
_FIRST_MATH_BLOCK = re.compile(r"(.*?)(\$)(.*?)(\$)(.*)")
_UNWRAP_PATTERNS = tuple(re.compile(r"(\\" + cmd + r"\{)(.*?)(\})") for cmd in ("text", "textbf", "overline", "mathbf"))
_BOXED = re.compile(r"(\\boxed\{)(.*)(\})")
_FRAC_SHORT = re.compile(r"(frac)([^{])(.)")
_SQRT_SHORT = re.compile(r"(sqrt)([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation: right of the last `=`, units and TeX wrappers dropped, `frac12` -> `frac{1}{2}`."""
    s = answer.split("=")[-1]
    bare = s.strip()
    if bare.isascii() and bare.lstrip("-").isdigit():  # a plain integer: every step below leaves it as is
        return _canonical_number(bare)
    s = s.replace("$$", "$")  # display math (ours: DAPO's $...$ step empties `$$42$$`)
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    if "$" in s:
        s = _FIRST_MATH_BLOCK.sub(r"$\3$", s)  # keep the first $...$ block
    if "\\" in s:
        for pattern in _UNWRAP_PATTERNS:
            s = pattern.sub(r"\2", s)
        s = _BOXED.sub(r"\2", s)
    if "frac" in s:
        s = _FRAC_SHORT.sub(r"frac{\2}{\3}", s)
    if "sqrt" in s:
        s = _SQRT_SHORT.sub(r"sqrt{\2}", s)
    s = s.replace("$", "")
    if _THOUSANDS.match(s):  # DAPO drops every comma between digits; we only thousands separators
        s = s.replace(",", "")
    return _canonical_number(s.strip())


def _canonical_number(s: str) -> str:
    for tok in _DECORATIONS:
        if tok in s:
            s = s.replace(tok, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\u2212", "-").strip()
    while len(s) > 1 and (s[0], s[-1]) in (("{", "}"), ("(", ")")) and _NUMBER.match(s[1:-1].strip("{}")):
        s = s[1:-1]
    if s[-1:] in (".", ",") and _NUMBER.match(s[:-1]):  # `Answer: 42.` / `42,` (upstream drops every comma)
        s = s[:-1]
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    m = _INTEGER_VALUED.match(s)
    if m is not None:
        s = m.group(1)
    if s.startswith("+") and _NUMBER.match(s):
        s = s[1:]
    return "0" if s == "-0" else s


def extract_dapo_answer(response: str) -> str:
    """The normalised text after the last `Answer:` in the response tail, or `[INVALID]`-normalised."""
    matches = ANSWER_PATTERN.findall(strip_eos_text(response)[-TAIL_CHARS:])
    return normalize_final_answer(matches[-1] if matches else INVALID)


def dapo_score(response: str, label, label_is_boxed: bool = False) -> dict:
    """`{"score": +1/-1, "acc": bool, "pred": str}` like DAPO's `compute_score`."""
    gold = str(label)
    if label_is_boxed:
        gold = extract_boxed_answer(gold) or gold
    pred = extract_dapo_answer(response)
    correct = pred == normalize_final_answer(gold)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def compute_score_dapo(response: str, label) -> float:
    """+1.0 if the `Answer:` line matches the label, else -1.0."""
    return dapo_score(response, label, label_is_boxed="\\boxed" in str(label))["score"]


def compute_score_dapo_answer(pred: str, label) -> float:
    """DAPO's +1/-1 for an already extracted answer (the `boxed_dapo` path: no `Answer:` line needed)."""
    gold = str(label)
    gold = extract_boxed_answer(gold) or gold
    return 1.0 if normalize_final_answer(pred) == normalize_final_answer(gold) else -1.0
