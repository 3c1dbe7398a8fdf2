"""Per-row sampling for a decode batch.

Log-probs follow SGLang: log_softmax((logits + logit_bias) / temperature) of
the sampled token, *not* renormalised after top-k / top-p / min-p (those only
restrict what may be drawn). As in SGLang, a temperature below 1e-6 (0
included) means greedy: it becomes top_k = 1 at temperature 1, so greedy
log-probs are log_softmax of the raw (biased) logits and never NaN or null.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-6  # SGLang's _SAMPLING_EPS: below it, sampling is greedy


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stop_regex: list[re.Pattern] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode, as SGLang does
    stream_interval: int | None = None  # stream a chunk every this many tokens (None: every token)

    def __post_init__(self) -> None:
        if 0.0 <= self.temperature < GREEDY_TEMPERATURE:
            self.temperature, self.top_k = 1.0, 1

    @property
    def greedy(self) -> bool:
        return self.top_k == 1


def biased_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Float logits with each row's logit_bias added (a copy only when some row has a bias)."""
    logits = logits.float()
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if rows:
        logits = logits.clone()
        for i in rows:
            ids = torch.tensor(list(params[i].logit_bias), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(params[i].logit_bias.values()), dtype=logits.dtype)
    return logits


def tempered_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """log_softmax((logits + bias) / T) per row: the distribution every returned log-prob is taken from."""
    return _scaled_log_softmax(biased_logits(logits, params), params)


def _scaled_log_softmax(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1), dim=-1)


def _restrict(logp: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude; rows keep at least their best token."""
    vocab = logp.shape[-1]
    need_k = bool(((top_ks > 0) & (top_ks < vocab)).any())
    need_p = bool((top_ps < 1.0).any())
    if need_k or need_p:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_lp, dtype=torch.bool)
        if need_k:
            ks = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
            drop |= torch.arange(vocab).unsqueeze(0) >= ks.unsqueeze(1)
        if need_p:
            probs = sorted_lp.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= top_ps.unsqueeze(1)
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter(1, order, drop)
        logp = logp.masked_fill(mask, float("-inf"))
    if bool((min_ps > 0).any()):
        thresh = logp.max(dim=-1, keepdim=True).values + torch.log(min_ps.clamp(min=1e-30)).unsqueeze(1)
        logp = torch.where((min_ps > 0).unsqueeze(1) & (logp < thresh), torch.full_like(logp, float("-inf")), logp)
    return logp


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Draw one token per row; return (token ids, log-probs under log_softmax((logits + bias) / T))."""
    logits = biased_logits(logits, params)
    n = logits.shape[0]
    greedy = [p.greedy for p in params]
    logp = _scaled_log_softmax(logits, params)
    tokens = logits.argmax(dim=-1)
    sample_rows = [i for i in range(n) if not greedy[i]]
    if sample_rows:
        idx = torch.tensor(sample_rows)
        sub = logp if len(sample_rows) == n else logp[idx]
        sub_params = [params[i] for i in sample_rows]
        sub = _restrict(
            sub,
            torch.tensor([p.top_k for p in sub_params]),
            torch.tensor([p.top_p for p in sub_params], dtype=sub.dtype),
            torch.tensor([p.min_p for p in sub_params], dtype=sub.dtype),
        )
        # inverse-CDF draw: one uniform per row (cheap, and per-request generators stay independent)
        cdf = sub.exp().cumsum(dim=-1)
        u = torch.empty(len(sample_rows), dtype=cdf.dtype)
        shared = [j for j, i in enumerate(sample_rows) if generators[i] is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=default_generator, dtype=cdf.dtype)
        for j, i in enumerate(sample_rows):
            if generators[i] is not None:
                u[j] = torch.rand(1, generator=generators[i], dtype=cdf.dtype)[0]
        targets = (u * cdf[:, -1]).unsqueeze(1)
        drawn = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
        tokens[idx] = drawn
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()
