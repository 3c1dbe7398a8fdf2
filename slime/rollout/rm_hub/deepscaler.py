"""DeepScaleR-style rule reward (`--rm-type deepscaler`): the last boxed answer after the reasoning, 1 if right else 0.

The format is part of the reward, as in DeepScaleR: a response without a finished reasoning block
(`</think>`, or the `###Response` marker) or without a boxed answer after it scores 0. Right means
`math_grader.answers_match` against any gold answer (a label may be a list of answers, or boxed).

Every answer upstream slime's DeepScaleR grader accepts is accepted (`\\text{45 degrees}` for `45`, `X+1` for
`x+1`, `\\boxed{\\boxed{3}}`; tests/test_upstream_plugin_api.py), except what it accepts only by accident of its
normalisation: a unit word after a word answer (`yes cm` for `yes`), `\\frac{1}{2}.0`, any two characters
before `=` (`+x=3` for `x=3`). Deliberate differences (every one also listed in `math_grader`'s docstring where it
concerns normalisation), all accepting more:
- we split at the FIRST `</think>` (upstream: the last): everything after the reasoning is the
  solution and its last boxed answer counts, so a stray `</think>` after the answer does not void it;
- `\\boxed 42` without braces and `\\fbox{42}` are read (upstream: 0), thin spaces `1\\,234` dropped;
- equal values are equal however they are written: `\\frac{2}{4}` is right for `\\frac{1}{2}` and
  `\\frac{4}{2}` for `2` (upstream rejects unreduced fractions and any non-integer form of an
  integer label);
- equivalence is decided by exact / numeric evaluation (`math_expr`, `math_value`), not `sympy.simplify`: same
  verdicts on the answers upstream's sympy accepts (`1+x^2` vs `x^2+1`, `\\sqrt{27}` vs `3\\sqrt{3}`,
  `\\pi \\cdot 2` vs `2\\pi`, mixed numbers), bounded time per call, and decimal approximations of
  irrational answers (`6.283185307` for `2\\pi`) are wrong as they are upstream;
- `-2\\frac{1}{2}` is -5/2 (upstream reads the mixed number as -2 + 1/2).
"""

from __future__ import annotations

from slime.rollout.rm_hub.math_grader import normalize_answer, normalized_match
from slime.rollout.rm_hub.math_utils import THINK_END, extract_answer, extract_boxed_answer, labels_of

RESPONSE_MARKER = "###Response"


def get_deepscaler_rule_based_reward(response: str, label) -> float:
    """1.0 iff the last `\\boxed{}` after `</think>` (or `###Response`) matches any gold answer, else 0.0."""
    if THINK_END in response:
        solution = response.split(THINK_END, 1)[1]
    elif RESPONSE_MARKER in response:
        solution = response.split(RESPONSE_MARKER, 1)[1]
    else:
        return 0.0
    pred = extract_boxed_answer(solution)
    if pred is None:
        return 0.0
    return 1.0 if grade_answer(pred, label) else 0.0


def grade_answer(pred: str, label) -> bool:
    """Does the extracted answer `pred` match any gold answer of `label`?"""
    normalized = normalize_answer(pred)
    if not normalized:
        return False
    return any(normalized_match(normalized, normalize_answer(gold)) for gold in labels_of(label))


def grade_answer_verl(solution_str: str, ground_truth) -> bool:
    """Upstream slime's (`from slime.rollout.rm_hub import grade_answer_verl`): is the last boxed answer of
    `solution_str` right for `ground_truth` (boxed or not), as `grade_answer` judges? An empty ground truth is
    never matched."""
    if ground_truth is None or str(ground_truth) == "":
        return False
    given = extract_answer(solution_str)
    return given is not None and grade_answer(given, ground_truth)
