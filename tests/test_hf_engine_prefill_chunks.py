"""prefill_chunks: mixed-length admissions are split so left padding stays bounded, and every row is kept once."""

import random

from slime.backends.hf_engine.scheduler import PAD_SLACK_TOKENS, prefill_chunks


def _check(lengths):
    chunks = prefill_chunks(lengths)
    flat = [i for c in chunks for i in c]
    assert sorted(flat) == list(range(len(lengths)))  # each row exactly once
    for c in chunks:
        padded = len(c) * max(lengths[i] for i in c)
        real = sum(lengths[i] for i in c)
        assert padded == real or padded <= PAD_SLACK_TOKENS, (c, padded, real)  # unpadded, or small
    return chunks


def test_long_resumed_row_is_not_padded_with_short_prompts():
    chunks = _check([300] + [6] * 39)
    assert [0] in chunks and len(chunks) == 2


def test_uniform_lengths_stay_one_prefill():
    assert _check([6] * 128) == [list(range(128))]
    assert _check([700] * 5) == [list(range(5))]  # long but unpadded: one mask-free prefill
    assert len(_check([100, 90, 110, 95])) == 1


def test_long_rows_of_different_lengths_are_not_padded_together():
    chunks = _check([600, 700, 700, 6, 6])
    assert sorted(map(sorted, chunks)) == [[0], [1, 2], [3, 4]]


def test_random_mixes_bound_padding():
    rng = random.Random(0)
    for _ in range(200):
        _check([rng.choice([6, 7, 12]) + int(rng.paretovariate(1.0) * 6) % 400 for _ in range(rng.randint(1, 64))])
    assert prefill_chunks([]) == []
