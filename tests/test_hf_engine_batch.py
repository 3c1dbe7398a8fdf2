"""DecodeBatch (the engine's KV layout) against an independent reference: every row run alone through the
model, one plain forward over its full token sequence, after every join, leave and decode step."""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.hf_engine.batch import DecodeBatch
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

WORDS = [str(i) for i in range(10)] + list("abcdefghijklmnopqrstuvwxyz")
SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=1024)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("batch_model")
    return build_tiny_qwen3(str(d), build_tokenizer(WORDS), SPEC, seed=0).float().eval()


class Mirror:
    """Drives a DecodeBatch and mirrors it: seqs[i] is row i's full sequence (its cache + its pending token)."""

    def __init__(self, model, seed: int = 0):
        self.model, self.batch, self.rng = model, DecodeBatch(model), random.Random(seed)
        self.vocab = model.config.vocab_size
        self.seqs: list[list[int]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    @torch.no_grad()
    def reference(self, seq: list[int]) -> torch.Tensor:
        return self.model(torch.tensor([seq])).logits[0, -1]

    def join(self, lengths: list[int], drop: tuple[int, ...] = ()) -> None:
        """Prefill prompts of `lengths`; the rows in `drop` finish at prefill and do not join."""
        prompts = [self.tokens(n) for n in lengths]
        logits, cache, valid = self.batch.prefill(prompts)
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], self.reference(p), atol=ATOL, rtol=0)
        rows = [i for i in range(len(prompts)) if i not in drop]
        pending = self.tokens(len(rows))
        self.batch.join(cache, valid, rows, [len(prompts[i]) for i in rows], pending)
        self.seqs += [prompts[i] + [t] for i, t in zip(rows, pending)]
        self.check_layout()

    def step(self) -> None:
        masks = []
        hook = self.model.register_forward_pre_hook(lambda mod, args, kw: masks.append(kw["attention_mask"]), with_kwargs=True)
        try:
            logits = self.batch.step()
        finally:
            hook.remove()
        assert logits.shape[0] == len(self.seqs)
        # the mask we pass covers exactly the keys the cache returns, in every layer
        for layer in self.batch.cache.layers:
            assert masks[0].shape == (len(self.seqs), 1, 1, layer.keys.shape[-2])
        for i, s in enumerate(self.seqs):
            torch.testing.assert_close(logits[i], self.reference(s), atol=ATOL, rtol=0)
        pending = self.tokens(len(self.seqs))
        self.batch.set_pending(pending)
        self.seqs = [s + [t] for s, t in zip(self.seqs, pending)]
        self.check_layout()

    def remove(self, rows: list[int]) -> None:
        order = self.batch.remove(rows)
        assert sorted(order) == sorted(set(range(len(self.seqs))) - set(rows))
        self.seqs = [self.seqs[i] for i in order]
        self.check_layout()

    def check_layout(self) -> None:
        b = self.batch
        assert b.size == len(self.seqs)
        assert b.next_pos.tolist() == [len(s) - 1 for s in self.seqs]
        assert b.pending.tolist() == [s[-1] for s in self.seqs]
        if not self.seqs:
            return
        assert b.hi <= b.valid.shape[1]
        for i, s in enumerate(self.seqs):  # right-aligned at hi, exactly the cached tokens, nothing stale
            assert b.valid[i].nonzero().flatten().tolist() == list(range(b.hi - (len(s) - 1), b.hi))
        assert b.lo == b.hi - max(len(s) - 1 for s in self.seqs) and b.width == b.hi - b.lo

    @property
    def capacity(self) -> tuple[int, int]:
        return tuple(self.batch.valid.shape)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_joins_leaves_and_steps_match_per_row_reference(model, seed):
    m = Mirror(model, seed)
    rng = random.Random(seed)
    shifts = 0  # joins into a non-empty batch of rows longer than the columns left of hi
    for t in range(70):
        op = rng.random()
        if m.seqs and t % 20 == 19:  # a row longer than the columns left of hi
            m.join([m.batch.hi + rng.randint(1, 30), rng.randint(1, 5)])
            shifts += 1
        elif not m.seqs or op < 0.2:
            n = rng.randint(1, 4)
            lengths = [rng.randint(1, 160 if rng.random() < 0.3 else 12) for _ in range(n)]
            drop = tuple(i for i in range(1, n) if rng.random() < 0.2)
            shifts += bool(m.seqs) and max(x for i, x in enumerate(lengths) if i not in drop) > m.batch.hi
            m.join(lengths, drop)
        elif op < 0.35:
            m.remove(rng.sample(range(len(m.seqs)), rng.randint(1, len(m.seqs))))
        else:
            m.step()
    assert shifts >= 1


def test_join_longer_than_the_window_shifts_the_batch(model):
    m = Mirror(model)
    m.join([3, 5])
    for _ in range(3):
        m.step()
    hi = m.batch.hi
    m.join([hi + 30, 2])  # longer than every column left of hi
    assert m.batch.hi >= hi + 30
    for _ in range(3):
        m.step()
    m.remove([2])  # the long row leaves: the window narrows back to the short rows
    assert m.batch.width == max(len(s) for s in m.seqs) - 1 < 20
    m.step()


def test_join_and_leave_copy_only_their_rows(model):
    m = Mirror(model)
    m.join([4, 6, 5, 7])
    m.step()
    ptrs = [k.data_ptr() for k in m.batch.k + m.batch.v]
    hi, row0 = m.batch.hi, m.batch.k[0][0].clone()
    m.remove([1])  # row 3 moves into slot 1; row 0 stays where it is
    assert torch.equal(m.batch.k[0][0], row0)
    m.join([3, 8])
    m.step()
    m.remove([0, 2])
    m.step()
    assert [k.data_ptr() for k in m.batch.k + m.batch.v] == ptrs and m.batch.hi == hi + 2
    m.remove(list(range(len(m.seqs))))  # empty: buffers are kept for the next rows
    assert m.batch.size == 0
    m.join([9])
    m.step()
    assert [k.data_ptr() for k in m.batch.k + m.batch.v] == ptrs


def test_compaction_when_hi_reaches_the_last_column(model):
    m = Mirror(model)
    m.join([5])
    r, w = m.capacity
    while m.batch.hi < w - 40:
        m.step()
    m.join([2])
    m.remove([0])  # the long-lived row leaves: a narrow window sits near the right edge
    compacted = False
    for _ in range(60):
        hi = m.batch.hi
        m.step()
        compacted |= m.batch.hi < hi
    assert compacted and m.capacity == (r, w)


def test_rows_and_columns_grow(model):
    m = Mirror(model)
    m.join([4, 6, 3])
    r, w = m.capacity
    m.join([2, 5, 7, 3, 1, 6, 4, 2])  # more rows than slots
    assert m.capacity[0] >= 11 > r
    m.step()
    while m.capacity[1] == w:  # long-lived rows: the window outgrows the columns
        m.step()
    assert m.capacity[1] > w
    m.step()


def test_equal_length_prefill_takes_the_unmasked_path_and_matches(model):
    """Rows of one length are prefilled without a mask (transformers' causal path); logits and the joined
    cache must match the per-row reference exactly as the masked (padded) path does."""
    m = Mirror(model, seed=7)
    masks = []
    def record(mod, args, kw):  # the engine's forwards only (the reference passes no cache)
        if kw.get("past_key_values") is not None:
            masks.append(kw.get("attention_mask"))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        m.join([40, 40, 40])  # equal: unmasked
        m.join([9, 30])  # unequal: masked
    finally:
        hook.remove()
    assert masks[0] is None and masks[1] is not None
    for _ in range(3):
        m.step()


def test_row_kv_round_trip_rejoins_a_row_that_left(model):
    """row_kv + join_kv (the prefix cache's path): a row saved, removed and joined back decodes exactly as
    if it had never left."""
    m = Mirror(model, seed=11)
    m.join([7, 12, 5])
    m.step()
    i = 1
    n = len(m.seqs[i]) - 1  # cached positions (all but the pending token)
    kv = m.batch.row_kv(i, n)
    seq = m.seqs[i]
    m.remove([i])
    m.join([9])  # the freed slot gets reused meanwhile
    m.batch.join_kv(kv, len(seq) - 1, seq[-1])
    m.seqs.append(seq)
    m.check_layout()
    for _ in range(3):
        m.step()
