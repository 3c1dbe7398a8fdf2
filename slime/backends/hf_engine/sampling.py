"""Per-row sampling for a decode batch.

Log-probs follow SGLang: log_softmax((logits + logit_bias) / temperature) of the sampled token, not renormalised
after top-k / top-p / min-p; a temperature below 1e-6 is greedy (top_k = 1 at temperature 1). `prepare_sampling`
(host, before the forward) and `sample_tokens` (device, after it) split a step so a GPU syncs once per step; the
uniforms come from CPU generators, so a seeded request draws the same tokens on CPU and GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from slime.backends.hf_engine.device import host_to_device

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
            ids = torch.tensor(list(params[i].logit_bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(params[i].logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def tempered_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """log_softmax((logits + bias) / T) per row: the distribution every returned log-prob is taken from."""
    logits = biased_logits(logits, params)
    temps = [p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return torch.log_softmax(logits, dim=-1)
    return torch.log_softmax(logits / torch.tensor(temps, dtype=logits.dtype, device=logits.device).unsqueeze(1), dim=-1)


@dataclass
class SamplingBatch:
    """One step's sampling inputs on the engine's device, built before the forward. Which restrictions apply
    is decided here, on the host, so sampling itself never asks the device."""

    n: int
    temps: torch.Tensor | None  # [n, 1] (None: every row at temperature 1)
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values) of every logit_bias
    rows: torch.Tensor | None  # rows that draw (None: no row draws, all greedy); all rows when `every_row_draws`
    every_row_draws: bool
    u: torch.Tensor | None  # [drawing rows] uniforms
    top_ks: torch.Tensor | None  # [drawing rows] kept tokens (None: no row restricts by top_k)
    top_ps: torch.Tensor | None  # [drawing rows] (None: no row restricts by top_p)
    min_ps: torch.Tensor | None  # [drawing rows] (None: no row restricts by min_p)


def prepare_sampling(params: list[SamplingParams], generators: list[torch.Generator | None],
                     default_generator: torch.Generator, vocab: int, device: torch.device | str = "cpu") -> SamplingBatch:
    """The host half: parameters and uniform draws (shared rows from `default_generator` in one draw, then each
    seeded row from its own generator, in row order) as tensors on `device`, in two copies (ints, floats)."""
    n = len(params)
    draw = [i for i, p in enumerate(params) if not p.greedy]
    ints: list[int] = []
    floats: list[float] = []
    u = torch.empty(len(draw), dtype=torch.float32)
    shared = [j for j, i in enumerate(draw) if generators[i] is None]
    if shared:
        u[shared] = torch.rand(len(shared), generator=default_generator, dtype=torch.float32)
    for j, i in enumerate(draw):
        if generators[i] is not None:
            u[j] = torch.rand(1, generator=generators[i], dtype=torch.float32)[0]
    sub = [params[i] for i in draw]
    need_k = any(0 < p.top_k < vocab for p in sub)
    need_p = any(p.top_p < 1.0 for p in sub)
    need_min_p = any(p.min_p > 0 for p in sub)
    bias_rows = [(i, t, v) for i, p in enumerate(params) for t, v in p.logit_bias.items()]
    temps = [p.temperature for p in params]
    plain_temps = all(t == 1.0 for t in temps)
    # one int tensor: [drawing rows | top_ks | bias rows | bias ids]; one float tensor: [u | temps | top_ps | min_ps | bias]
    ints += draw
    if need_k:
        ints += [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in sub]
    ints += [r for r, _, _ in bias_rows] + [t for _, t, _ in bias_rows]
    floats += u.tolist()
    if not plain_temps:
        floats += temps
    if need_p:
        floats += [p.top_p for p in sub]
    if need_min_p:
        floats += [p.min_p for p in sub]
    floats += [v for _, _, v in bias_rows]
    device = torch.device(device)
    ti = host_to_device(torch.tensor(ints, dtype=torch.long), device)
    tf = host_to_device(torch.tensor(floats, dtype=torch.float32), device)
    k, at = len(draw), 0

    def take_i(m):
        nonlocal at
        at += m
        return ti[at - m: at]

    rows = take_i(k) if draw else None
    top_ks = take_i(k) if need_k else None
    nb = len(bias_rows)
    bias = (take_i(nb), take_i(nb), tf[len(floats) - nb:]) if nb else None
    at_f = k
    out_u = tf[:k] if draw else None
    temps_t = None
    if not plain_temps:
        temps_t, at_f = tf[at_f: at_f + n].unsqueeze(1), at_f + n
    top_ps = min_ps = None
    if need_p:
        top_ps, at_f = tf[at_f: at_f + k], at_f + k
    if need_min_p:
        min_ps, at_f = tf[at_f: at_f + k], at_f + k
    return SamplingBatch(n, temps_t, bias, rows, len(draw) == n, out_u, top_ks, top_ps, min_ps)


def _restrict(logp: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k / top-p / min-p exclude; rows keep at least their best token."""
    vocab = logp.shape[-1]
    if sb.top_ks is not None or sb.top_ps is not None:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_lp, dtype=torch.bool)
        if sb.top_ks is not None:
            drop |= torch.arange(vocab, device=logp.device).unsqueeze(0) >= sb.top_ks.unsqueeze(1)
        if sb.top_ps is not None:
            probs = sorted_lp.softmax(dim=-1)
            # drop a token when the mass strictly before it already reaches top_p
            before = probs.cumsum(dim=-1) - probs
            drop |= before >= sb.top_ps.unsqueeze(1)
        drop[:, 0] = False
        mask = torch.zeros_like(drop).scatter(1, order, drop)
        logp = logp.masked_fill(mask, float("-inf"))
    if sb.min_ps is not None:
        min_ps = sb.min_ps
        thresh = logp.max(dim=-1, keepdim=True).values + torch.log(min_ps.clamp(min=1e-30)).unsqueeze(1)
        logp = torch.where((min_ps > 0).unsqueeze(1) & (logp < thresh), torch.full_like(logp, float("-inf")), logp)
    return logp


def sample_tokens(logits: torch.Tensor, sb: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The device half: (token ids [n], log-probs [n] under log_softmax((logits + bias) / T)), on the logits'
    device; nothing here waits for the device."""
    logits = logits.float()
    if sb.bias is not None:  # (row, token) pairs are distinct: a plain write (CUDA's accumulating one sorts first)
        rows, ids, values = sb.bias
        logits = logits.index_put((rows, ids), logits[rows, ids] + values)
    logp = torch.log_softmax(logits if sb.temps is None else logits / sb.temps, dim=-1)
    tokens = None if sb.rows is not None and sb.every_row_draws else logits.argmax(dim=-1)  # greedy rows' tokens
    if sb.rows is not None:
        sub = _restrict(logp if sb.every_row_draws else logp.index_select(0, sb.rows), sb)
        # inverse-CDF draw: one uniform per row (cheap, and per-request generators stay independent)
        cdf = sub.exp().cumsum_(dim=-1)
        targets = (sb.u * cdf[:, -1]).unsqueeze(1)
        drawn = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=cdf.shape[1] - 1)
        tokens = drawn if sb.every_row_draws else tokens.index_copy(0, sb.rows, drawn)
    chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens, chosen


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """Token ids and log-probs as Python lists, in one device-to-host copy (float64 holds both exactly)."""
    n = tokens.shape[0]
    both = torch.cat([tokens.to(torch.float64), logprobs.to(torch.float64)]).tolist()
    return [int(t) for t in both[:n]], both[n:]


def sample_batch(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[float]]:
    """Draw one token per row; return (token ids, log-probs under log_softmax((logits + bias) / T))."""
    sb = prepare_sampling(params, generators, default_generator, logits.shape[-1], logits.device)
    return to_host(*sample_tokens(logits, sb))
