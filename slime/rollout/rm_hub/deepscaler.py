"""DeepScaleR-style rule reward: the boxed answer after the reasoning, 1 if right else 0."""

from __future__ import annotations

from slime.rollout.rm_hub.math_utils import answers_match, extract_boxed_answer, labels_of

THINK_END = "</think>"
RESPONSE_MARKER = "###Response"


def get_deepscaler_rule_based_reward(response: str, label) -> float:
    """1.0 iff the last `\\boxed{}` after `</think>` (or `###Response`) matches any gold answer.

    A response with no finished reasoning block, or no boxed answer after it,
    gets 0.0 (as in DeepScaleR: the format is part of the reward).
    """
    if THINK_END in response:
        solution = response.split(THINK_END, 1)[1]
    elif RESPONSE_MARKER in response:
        solution = response.split(RESPONSE_MARKER, 1)[1]
    else:
        return 0.0
    pred = extract_boxed_answer(solution)
    if pred is None:
        return 0.0
    return 1.0 if any(answers_match(pred, gold) for gold in labels_of(label)) else 0.0
