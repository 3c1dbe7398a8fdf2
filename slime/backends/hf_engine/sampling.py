"""Per-row sampling for a decode batch.

Log-probs follow SGLang: log_softmax(logits / temperature) of the sampled
token, *not* renormalised after top-k / top-p / min-p (those only restrict
what may be drawn). Temperature 0 (or top_k == 1) is greedy, and its log-prob
is log_softmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


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
    """Draw one token per row; return (token ids, log-probs under log_softmax(logits / T))."""
    logits = logits.float()
    n = logits.shape[0]
    greedy = [p.greedy for p in params]
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if all(t == 1.0 for t in temps):
        logp = torch.log_softmax(logits, dim=-1)
    else:
        logp = torch.log_softmax(logits / torch.tensor(temps, dtype=logits.dtype).unsqueeze(1), dim=-1)
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
