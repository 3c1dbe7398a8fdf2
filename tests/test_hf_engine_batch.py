"""PagedBatch (the engine's paged KV cache and packed steps) against an independent reference."""

from __future__ import annotations

import random

import pytest
import torch

from slime.backends.hf_engine.batch import PagedBatch
from slime.backends.hf_engine.kv_pool import KVPool, OutOfBlocks
from slime.backends.hf_engine.paged_attention import plan_buckets
from hf_engine_reference import load_model as load, tiny_model, tiny_spec

SPEC = tiny_spec(1024)
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "batch_model", seed=0, spec=SPEC)[0]


@pytest.fixture(scope="module")
def ref_model(model_dir):
    return load(model_dir)


class Mirror:
    """Drives a PagedBatch and mirrors it."""

    def __init__(self, model_dir, ref, seed=0, block_size=4, kernel="sdpa", **kw):
        self.batch = PagedBatch(load(model_dir), block_size=block_size, kernel=kernel, **kw)
        self.ref, self.rng = ref, random.Random(seed)
        self.vocab = ref.config.vocab_size
        self.seqs: dict[int, list[int]] = {}
        self.held: list[tuple[list[int], list[int], int]] = []  # detached rows: (seq, blocks, cached)
        self.buckets_seen = 0
        self.external: list[int] = []  # blocks held outside the batch and `held` (a stand-in prefix cache)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]

    @torch.no_grad()
    def reference(self, seq: list[int]) -> torch.Tensor:
        return self.ref(torch.tensor([seq])).logits[0, -1]

    def add(self, n: int) -> int:
        row = self.batch.add_row()
        self.seqs[row] = self.tokens(n)
        self.check()
        return row

    def step(self, max_chunk: int = 1000, whole: bool = False) -> None:
        """One packed step: decoding rows feed their last token, the others a random chunk of their prompt."""
        segs, sampled = [], []
        for row, seq in self.seqs.items():
            left = len(seq) - self.batch.cached(row)
            take = left if whole else self.rng.randint(1, min(left, max_chunk))
            start = self.batch.cached(row)
            segs.append((row, seq[start: start + take], take == left))
            if take == left:
                sampled.append(row)
        logits = self.batch.forward(segs)
        self.buckets_seen = max(self.buckets_seen, sum(1 for bk in self.batch.last_plan.buckets if bk.q == 1))
        assert logits.shape[0] == len(sampled)
        for i, row in enumerate(sampled):
            torch.testing.assert_close(logits[i], self.reference(self.seqs[row]), atol=ATOL, rtol=0)
            self.seqs[row].append(self.tokens(1)[0])  # the "sampled" token, fed next step
        self.check()

    def drop(self, row: int) -> None:
        self.batch.drop(row)
        del self.seqs[row]
        self.check()

    def detach(self, row: int) -> None:
        blocks, cached = self.batch.detach(row)
        self.held.append((self.seqs.pop(row), blocks, cached))
        self.check()

    def resume(self) -> int:
        seq, blocks, cached = self.held.pop(self.rng.randrange(len(self.held)))
        row = self.batch.add_row(blocks, cached)
        self.seqs[row] = seq
        self.check()
        return row

    def check(self) -> None:
        b, bs = self.batch, self.batch.block_size
        owned = [blk for row in self.seqs for blk in b._blocks[row]] + [blk for _, blks, _ in self.held for blk in blks]
        owned += self.external
        assert len(owned) == len(set(owned)) and 0 not in owned  # no block shared, block 0 never handed out
        assert b.pool.num_used == len(owned)  # nothing leaked
        for row, seq in self.seqs.items():
            c = b.cached(row)
            assert 0 <= c < len(seq) and len(b._blocks[row]) == -(-c // bs) or len(b._blocks[row]) * bs >= c
            assert b.tables[row, : len(b._blocks[row])].tolist() == b._blocks[row]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_joins_leaves_resumes_and_chunked_steps_match_per_row_reference(model_dir, ref_model, seed):
    m = Mirror(model_dir, ref_model, seed, min_bucket_saving=16)  # split buckets even at these short lengths
    rng = random.Random(seed)
    for t in range(60):
        op = rng.random()
        if not m.seqs or op < 0.15:
            for _ in range(rng.randint(1, 4)):
                m.add(rng.randint(1, 120 if rng.random() < 0.3 else 10))
        elif op < 0.22 and len(m.seqs) > 1:
            m.drop(rng.choice(list(m.seqs)))
        elif op < 0.3 and m.seqs:
            m.detach(rng.choice(list(m.seqs)))  # an abort: its blocks go to the prefix cache
        elif op < 0.36 and m.held:
            m.resume()
        else:
            m.step(max_chunk=rng.choice([3, 16, 1000]))
    assert m.buckets_seen >= 2  # rows of different lengths were split into several decode buckets


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_long_and_short_rows_share_steps(model_dir, ref_model, kernel):
    """A long prompt prefilled in chunks while short rows decode, across many blocks; both kernels."""
    m = Mirror(model_dir, ref_model, seed=5, block_size=8, kernel=kernel)
    for n in (3, 5, 200, 2, 70):
        m.add(n)
    for _ in range(12):
        m.step(max_chunk=48)
    assert all(m.batch.cached(r) == len(s) - 1 for r, s in m.seqs.items())  # everyone is decoding now
    m.add(150)
    for _ in range(6):
        m.step(max_chunk=64)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_masked_prefill_attention_matches_the_reference(model_dir, ref_model, kernel):
    """The GPU's way of attending a prefill chunk with a prefix, checked here on the CPU."""
    m = Mirror(model_dir, ref_model, seed=11, block_size=4, kernel=kernel, prefill_attention="masked")
    for n in (90, 3, 41, 7):
        m.add(n)
    for _ in range(14):
        m.step(max_chunk=13)  # chunks start mid-block and span blocks
    assert all(m.batch.cached(r) == len(s) - 1 for r, s in m.seqs.items())
    m.detach(next(iter(m.seqs)))
    m.add(60)
    m.resume()
    for _ in range(8):
        m.step(max_chunk=16)
    with pytest.raises(ValueError, match="prefill_attention must be auto, split or masked"):
        PagedBatch(m.ref, prefill_attention="fused")


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_prefill_chunks_of_many_shapes_share_padded_buckets_and_match_the_reference(model_dir, ref_model, kernel):
    """Off the CPU prefill chunks of different lengths share a bucket padded to the longest."""
    m = Mirror(model_dir, ref_model, seed=13, block_size=4, kernel=kernel, prefill_attention="masked")
    rows = [m.add(n) for n in (2, 3, 5, 9, 17, 33)]
    m.step(max_chunk=1000, whole=True)  # six fresh prompts, six lengths
    prefill = [bk for bk in m.batch.last_plan.buckets if bk.q > 1]
    assert len(prefill) == 1 and prefill[0].pad is not None and prefill[0].cells == 2 + 3 + 5 + 9 + 17 + 33
    for _ in range(2):
        m.step()  # decoding
    for row, n in zip(rows, (7, 4, 11, 2, 6, 23)):  # each row gets a chunk of new tokens after its prefix
        m.seqs[row] += m.tokens(n)
    m.step(whole=True)
    prefill = [bk for bk in m.batch.last_plan.buckets if bk.q > 1]
    assert len(prefill) == 1 and prefill[0].p0 > 0 and prefill[0].pad is not None
    late = [m.add(n) for n in (12, 40)]  # fresh prompts again, beside chunks after a prefix and decoding rows
    m.seqs[rows[0]] += m.tokens(5)
    m.step(whole=True)
    assert {bool(bk.p0) for bk in m.batch.last_plan.buckets if bk.q > 1} == {False, True}
    for _ in range(3):
        m.step()
    assert all(m.batch.cached(r) == len(m.seqs[r]) - 1 for r in rows + late)


def test_padded_prefill_buckets_waste_at_most_their_bound():
    """merge_prefill: each segment in one bucket, padding maps exact, padded pairs within 2x the exact plus slack."""
    from slime.backends.hf_engine.paged_attention import PAD_SLACK_PAIRS

    tables = torch.arange(256 * 600).view(256, 600)
    rng = random.Random(3)
    for trial in range(30):
        segs = [(1, rng.randint(0, 3000), r) for r in range(rng.randint(0, 40))]
        for r in range(len(segs), len(segs) + rng.randint(1, 60)):
            q = rng.choice([2, 6, rng.randint(2, 120), 512])
            segs.append((q, 0 if rng.random() < 0.6 else rng.randint(1, 4000), r))
        buckets = plan_buckets(segs, tables, block_size=32, merge_prefill=True)
        assert sorted(i for bk in buckets for i in bk.segments) == list(range(len(segs)))
        start = 0
        for bk in buckets:
            assert bk.start == start and bk.cells == sum(segs[i][0] for i in bk.segments)
            start += bk.cells
            if bk.q == 1:
                continue
            assert len({segs[i][1] == 0 for i in bk.segments}) == 1  # fresh and prefixed chunks apart
            keys = [segs[i][0] + (segs[i][1] if bk.p0 else 0) for i in bk.segments]
            exact = sum(segs[i][0] * k for i, k in zip(bk.segments, keys))
            assert bk.b == 1 or bk.b * bk.q * max(keys) <= 2 * exact + PAD_SLACK_PAIRS
            if bk.pad is None:
                assert all(segs[i][0] == bk.q for i in bk.segments)
                continue
            gather, keep = bk.pad[0].tolist(), bk.pad[1].tolist()
            at = 0
            for r, i in enumerate(bk.segments):
                n = segs[i][0]
                assert gather[r * bk.q: (r + 1) * bk.q] == [at + min(j, n - 1) for j in range(bk.q)]
                assert keep[at: at + n] == [r * bk.q + j for j in range(n)]
                assert bk.limit[r].tolist() == [segs[i][1] + min(j, n - 1) for j in range(bk.q)]
                at += n
    one_long = [(512, 0, 0)] + [(6, 0, r) for r in range(1, 40)]
    buckets = plan_buckets(one_long, tables, block_size=32, merge_prefill=True)
    assert len(buckets) == 2 and buckets[0].b <= 8  # no more than a few of 39 6-token prompts padded to 512


def test_join_and_leave_copy_no_kv(model_dir, ref_model):
    """Rows joining, leaving and resuming never move another row's KV."""
    m = Mirror(model_dir, ref_model, seed=3, block_size=4)
    a = m.add(9)
    m.add(5)
    m.step()
    m.step()
    pool = m.batch.pool
    ptrs = [t.data_ptr() for t in pool._kv.values()]
    blocks, cached = torch.tensor(m.batch._blocks[a]), m.batch.cached(a)

    def row_a():  # row a's cached positions, every layer, keys and values
        return [t.index_select(1, blocks).flatten(1, 2)[:, :cached].clone() for i in pool._kv for t in pool.layer(i)]

    before = row_a()
    b = m.add(7)
    m.step()
    m.detach(b)
    m.drop([r for r in m.seqs if r != a][0])
    m.resume()
    assert all(torch.equal(x, y) for x, y in zip(row_a(), before))
    assert [t.data_ptr() for t in pool._kv.values()] == ptrs
    m.step()


def test_pool_grows_mid_run_and_rows_stay_exact(model_dir, ref_model):
    m = Mirror(model_dir, ref_model, seed=9, block_size=4)
    m.batch.pool = KVPool(4, max_blocks=10_000, initial_blocks=4)  # tiny: the first steps grow it
    for n in (30, 50, 12):
        m.add(n)
    for _ in range(8):
        m.step(max_chunk=20)
    assert m.batch.pool.capacity > 4


def test_pool_reclaims_then_refuses_past_its_cap(model_dir, ref_model):
    m = Mirror(model_dir, ref_model, seed=4, block_size=4, max_tokens=16, max_rows=1)
    asked = []
    held = m.external = m.batch.pool.alloc(3)  # someone else (the prefix cache) holds blocks
    m.batch.reclaim = lambda n: (asked.append(n), m.batch.pool.free([held.pop() for _ in range(min(n, len(held)))]))
    m.add(20)
    m.step(whole=True)  # 5 blocks of 4 needed; 2 of the 5 usable ones are free: the holder gives 3 back
    assert asked == [3] and not held
    m.add(4)
    with pytest.raises(OutOfBlocks):
        m.step(whole=True)


def test_plan_buckets_cover_every_segment_once():
    tables = torch.arange(64 * 100).view(64, 100)
    rng = random.Random(0)
    segs = []
    for row in range(60):
        segs.append((1 if row < 50 else rng.randint(2, 9), rng.choice([1, 5, 40, 300, 2900]), row))
    segs += [(4, 0, 60), (4, 0, 61)]  # two fresh prompts of one length: one bucket
    buckets = plan_buckets(segs, tables, block_size=32)
    assert sorted(i for bk in buckets for i in bk.segments) == list(range(len(segs)))
    start = 0
    for bk in buckets:  # cells are numbered bucket after bucket, row by row
        assert bk.start == start and all(segs[i][0] == bk.q for i in bk.segments)
        start += bk.b * bk.q
        assert bk.blocks.numel() == bk.b * bk.m
        assert bk.blocks.view(bk.b, bk.m).tolist() == [tables[segs[i][2], : bk.m].tolist() for i in bk.segments]
        assert int(bk.limit.max()) < bk.m * 32  # every cell's keys fit in the bucket's blocks
    decode = [bk for bk in buckets if bk.q == 1]
    assert len(decode) >= 3 and sum(bk.b for bk in decode) == 50  # lengths 1..2900: several buckets
    assert any(bk.q == 4 and bk.b == 2 for bk in buckets)


def test_decode_shape_is_what_the_plan_gathers():
    """The simulator replays the engine's bucket rule from positions alone (hf_engine/buckets.py)."""
    from slime.backends.hf_engine.buckets import decode_shape

    tables = torch.zeros(128, 200, dtype=torch.long)
    rng = random.Random(1)
    for trial in range(200):
        n = rng.randint(1, 120)
        positions = [rng.choice([rng.randint(0, 40), rng.randint(0, 400), rng.randint(0, 5000)]) for _ in range(n)]
        buckets = plan_buckets([(1, p, row) for row, p in enumerate(positions)], tables, block_size=32)
        assert decode_shape(positions, 32) == (sum(bk.b * bk.m for bk in buckets) * 32, len(buckets)), positions
