"""Prompt log-probs (`logprob_start_len`), top-k log-probs (`top_logprobs_num`) and chosen ids' log-probs
(`token_ids_logprob`), as SGLang returns them: from log_softmax(logits / T), with the logit_bias on output
positions only; prompt position 0 gives None. Hooks: `fill_prompt_logprobs` at admission (a scoring forward of its
own) and `record_output_logprobs` after sampling; both are no-ops for requests that did not ask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from slime.backends.hf_engine.sampling import tempered_logprobs

LOWEST_LOGPROB = -3.4028234663852886e38  # float32's lowest: what an impossible token reports (JSON has no -inf)


@dataclass(frozen=True)
class LogprobSpec:
    """What one request asked for beyond its sampled tokens' log-probs."""

    start_len: int = -1  # logprob_start_len: first prompt position with a log-prob (-1: none)
    top_k: int = 0  # top_logprobs_num
    token_ids: tuple[int, ...] = ()  # token_ids_logprob

    @property
    def wants_prompt(self) -> bool:
        return self.start_len >= 0

    @property
    def wants_output_extras(self) -> bool:
        return self.top_k > 0 or bool(self.token_ids)

    @property
    def any(self) -> bool:
        return self.wants_prompt or self.wants_output_extras


TopList = list[tuple[float, int]]  # [(log-prob, token id)], best first


@dataclass
class LogprobRecord:
    """A request's extra log-probs, filled on the scheduler thread."""

    spec: LogprobSpec
    prompt_ids: list[int] = field(default_factory=list)  # the prompt tokens from start_len on
    prompt: list[float | None] | None = None  # per prompt position from start_len; None at position 0
    prompt_top: list[TopList | None] | None = None
    prompt_token_ids: list[list[float] | None] | None = None
    output_top: list[TopList] = field(default_factory=list)  # per output token
    output_token_ids: list[list[float]] = field(default_factory=list)

    def snapshot(self) -> "LogprobRecord":
        return LogprobRecord(self.spec, self.prompt_ids, self.prompt, self.prompt_top, self.prompt_token_ids,
                             list(self.output_top), list(self.output_token_ids))


def finite(x: float) -> float:
    return x if math.isfinite(x) else LOWEST_LOGPROB


def _top(row: torch.Tensor, k: int) -> TopList:
    vals, ids = row.topk(min(k, row.shape[-1]))
    return [(finite(v), i) for v, i in zip(vals.tolist(), ids.tolist())]


def _chosen(row: torch.Tensor, ids: tuple[int, ...]) -> list[float]:
    return [finite(v) for v in row[list(ids)].tolist()]


@torch.inference_mode()
def fill_prompt_logprobs(model, req) -> None:
    """Fill `req.logprobs_extra`'s prompt fields from one forward of `req.input_ids` (once per request)."""
    rec: LogprobRecord | None = req.logprobs_extra
    if rec is None or not rec.spec.wants_prompt or rec.prompt is not None:
        return
    ids, start = req.input_ids, rec.spec.start_len
    first = max(start, 1) - 1  # logits at position p predict token p + 1
    keep = len(ids) - first
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=keep, use_cache=False).logits[0, :-1]
    logp = tempered_logprobs(logits, [_no_bias(req.params)] * logits.shape[0])
    rec.prompt_ids = list(ids[start:])
    lead = [None] if start == 0 else []
    chosen = logp.gather(1, torch.tensor(ids[first + 1:], device=device)[:, None]).squeeze(1)
    rec.prompt = lead + [finite(v) for v in chosen.tolist()]
    if rec.spec.top_k:
        rec.prompt_top = lead + [_top(row, rec.spec.top_k) for row in logp]
    if rec.spec.token_ids:
        rec.prompt_token_ids = lead + [_chosen(row, rec.spec.token_ids) for row in logp]


def record_output_logprobs(reqs: list, logits: torch.Tensor) -> None:
    """Append the top-k / chosen-id log-probs of this step's position for each request that asked."""
    for i, r in enumerate(reqs):
        rec: LogprobRecord | None = r.logprobs_extra
        if rec is None or not rec.spec.wants_output_extras:
            continue
        row = tempered_logprobs(logits[i: i + 1], [r.params])[0]
        if rec.spec.top_k:
            rec.output_top.append(_top(row, rec.spec.top_k))
        if rec.spec.token_ids:
            rec.output_token_ids.append(_chosen(row, rec.spec.token_ids))


def _no_bias(params):
    """Prompt log-probs use the request's temperature but not its logit_bias (a sampler-side adjustment)."""
    return replace(params, logit_bias={}) if params.logit_bias else params
