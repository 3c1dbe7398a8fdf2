"""Sampling of the embedded engine: restrictions, log-prob semantics, distribution, seeds."""

from __future__ import annotations

import torch

from slime.backends.hf_engine.sampling import SamplingParams, sample_batch


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_and_top_k_1_log_probs_use_temperature():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.5, 2.9]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=1)]
    toks, lps = sample_batch(logits, params, [None, None], _gen(0))
    assert toks == [1, 0]
    assert abs(lps[0] - torch.log_softmax(logits[0], -1)[1].item()) < 1e-6
    assert abs(lps[1] - torch.log_softmax(logits[1] / 0.5, -1)[0].item()) < 1e-6


def test_restrictions_only_limit_choice_not_log_probs():
    torch.manual_seed(0)
    row = torch.randn(50)
    n = 4000
    logits = row.expand(n, 50).clone()
    cases = {
        "top_k": SamplingParams(temperature=0.8, top_k=3),
        "top_p": SamplingParams(temperature=1.2, top_p=0.5),
        "min_p": SamplingParams(temperature=1.0, min_p=0.3),
    }
    for name, p in cases.items():
        toks, lps = sample_batch(logits, [p] * n, [None] * n, _gen(1))
        scaled = torch.log_softmax(row / p.temperature, -1)
        if name == "top_k":
            allowed = set(scaled.topk(3).indices.tolist())
        elif name == "top_p":
            order = scaled.argsort(descending=True)
            probs = scaled.exp()[order]
            before = probs.cumsum(0) - probs
            allowed = set(order[before < 0.5].tolist())
        else:
            probs = scaled.exp()
            allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
        assert set(toks) <= allowed and len(set(toks)) == len(allowed), name
        # log-probs are the temperature-scaled ones, not renormalised over the allowed set
        assert torch.allclose(torch.tensor(lps), scaled[torch.tensor(toks)], atol=1e-6), name


def test_draws_follow_the_tempered_distribution():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0])
    n = 40000
    toks, _ = sample_batch(row.expand(n, 5).clone(), [SamplingParams(temperature=0.7)] * n, [None] * n, _gen(2))
    freq = torch.bincount(torch.tensor(toks), minlength=5).float() / n
    expected = torch.softmax(row / 0.7, -1)
    assert torch.allclose(freq, expected, atol=0.01), (freq, expected)


def test_per_request_generators_are_independent_of_the_batch():
    logits = torch.randn(3, 100, generator=_gen(3))
    p = SamplingParams(temperature=1.0)
    alone = [sample_batch(logits[1:2], [p], [_gen(42)], _gen(0))[0][0] for _ in range(1)]
    in_batch = sample_batch(logits, [p, p, p], [None, _gen(42), None], _gen(9))[0][1]
    assert alone[0] == in_batch
