"""DeepScaleR-style rule reward (`--rm-type deepscaler`): the last boxed answer after a finished reasoning block,
1 if it matches a gold answer (`math_grader`) else 0; it accepts all upstream's grader does, and more."""

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
    """Upstream's: is the last boxed answer of `solution_str` right? An empty truth never matches."""
    if ground_truth is None or str(ground_truth) == "":
        return False
    given = extract_answer(solution_str)
    return given is not None and grade_answer(given, ground_truth)
