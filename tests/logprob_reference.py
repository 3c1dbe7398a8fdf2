"""The reference a rollout's log-probs are checked against: the model's own, teacher-forced over the sample."""

from __future__ import annotations

import torch


def teacher_forced(model, sample) -> list[float]:
    """Log-prob of each response token of `sample` under `model` (one forward over prompt + response)."""
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    start = sample.prompt_length
    return [lp[start - 1 + i, t].item() for i, t in enumerate(sample.response_tokens)]
