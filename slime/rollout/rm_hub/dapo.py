"""DAPO's math reward (as in DAPO / verl `math_dapo`): +1 for a right `Answer:` line, -1 otherwise.

Convention kept from DAPO: only the last 300 characters of the response are
looked at; the prediction is the text after the last `Answer:` (case
insensitive) up to the end of that line; prediction and gold go through the
Minerva-style `normalize_final_answer` and must then be equal as strings
(no numeric fallback); a missing `Answer:` line scores -1.
"""

from __future__ import annotations

import re

from slime.rollout.rm_hub.math_utils import extract_boxed_answer

TAIL_CHARS = 300
ANSWER_PATTERN = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"

# (before, after) substitutions, then whole expressions deleted (units, filler words, spacing macros)
_SUBSTITUTIONS = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
    ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
    ",\\!", "{,}", '"', "\\dots",
)


def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation: right of the last `=`, units and TeX wrappers dropped, `frac12` -> `frac{1}{2}`."""
    s = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)  # keep the first $...$ block
    for cmd in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + cmd + r"\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_dapo_answer(response: str) -> str:
    """The normalised text after the last `Answer:` in the response tail, or `[INVALID]`-normalised."""
    matches = ANSWER_PATTERN.findall(response[-TAIL_CHARS:])
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
