"""Upstream slime's DAPO reward module (`compute_score(solution_str, ground_truth, strict_box_verify=False,
pause_tokens_index=None)`), for plugins; the `Answer:` line is read as `--rm-type dapo` reads it."""

from __future__ import annotations

from slime.rollout.rm_hub.dapo import dapo_score, normalize_final_answer
from slime.rollout.rm_hub.math_utils import last_boxed_only_string, remove_boxed

__all__ = ["compute_score", "is_correct_strict_box", "last_boxed_only_string", "normalize_final_answer",
           "remove_boxed", "verify"]

STRICT_BOX_TAIL = 100
PAUSE_TOKENS = 4


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, the boxed answer) for the last boxed answer near the end of `pred` against `gt`, as strings."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != PAUSE_TOKENS:
            raise ValueError(f"pause_tokens_index must hold {PAUSE_TOKENS} indices, got {len(pause_tokens_index)}")
        pred = pred[pause_tokens_index[-1] - STRICT_BOX_TAIL:]
    else:
        pred = pred[-STRICT_BOX_TAIL:]
    boxed = last_boxed_only_string(pred)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    """(correct, the predicted answer)."""
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    out = dapo_score(solution_str, answer, label_is_boxed="\\boxed" in str(answer))
    return out["acc"], out["pred"]


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """`{"score": 1.0 if right else -1.0, "acc": right, "pred": the predicted answer}`."""
    correct, pred = verify(solution_str, ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
