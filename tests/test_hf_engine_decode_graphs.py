"""The decode step's CUDA-graph path, checked on the CPU in its "static" mode."""

from __future__ import annotations

import random

import pytest
import torch

from hf_engine_reference import greedy_reference, load_model, tiny_model, tiny_spec
from slime.backends.hf_engine.batch import PagedBatch
from slime.backends.hf_engine.buckets import graph_blocks as block_bucket, graph_rows as row_bucket
from slime.backends.hf_engine.decode_graphs import GraphModeError, resolve_mode
from slime.backends.hf_engine.sampling import SamplingParams
from slime.backends.hf_engine.scheduler import Request, Scheduler

ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "graph_model", seed=3, spec=tiny_spec(512))[0]


def load(model_dir):
    from transformers import AutoTokenizer

    return load_model(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def ref(model_dir):
    return load(model_dir)[0]


def test_buckets_and_modes():
    assert [row_bucket(n, 128) for n in (1, 2, 3, 5, 9, 17, 100, 128)] == [1, 2, 4, 8, 16, 32, 128, 128]
    assert row_bucket(129, 128) is None and row_bucket(97, 100) == 100 and row_bucket(3, 3) == 3
    assert [block_bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    cpu = torch.device("cpu")
    assert resolve_mode("auto", cpu) == "off" and resolve_mode("static", cpu) == "static"
    with pytest.raises(GraphModeError, match="capture needs a CUDA device"):
        resolve_mode("capture", cpu)
    with pytest.raises(GraphModeError, match="--cuda-graph-mode: expected"):
        resolve_mode("eager", cpu)


@torch.no_grad()
def test_static_decode_steps_match_a_plain_forward_through_joins_leaves_and_pool_growth(model_dir, ref):
    rng = random.Random(0)
    batch = PagedBatch(load(model_dir)[0], block_size=4, max_tokens=4096, max_rows=16, decode_graphs="static",
                       graph_max_rows=8)
    batch.pool.initial_blocks = 8  # small, so that the pool grows (and moves) while rows decode
    batch.pool._reset()
    seqs: dict[int, list[int]] = {}

    def add(n):
        row = batch.add_row()
        seqs[row] = [1] + [rng.randrange(3, 30) for _ in range(n - 1)]
        batch.forward([(row, seqs[row][:-1], False)] if n > 1 else [(row, seqs[row][-1:], True)])
        if n == 1:
            seqs[row].append(rng.randrange(3, 30))

    shapes, generations = set(), set()
    for n in (5, 1, 9):
        add(n)
    for t in range(40):
        if t in (6, 14, 22):
            add(rng.randint(2, 30))  # a prefill step (eager), then every row decodes again
        if t in (10, 30):
            row = rng.choice(list(seqs))
            batch.drop(row)
            del seqs[row]
        rows = list(seqs)
        steps_before = batch.graphs.steps
        logits = batch.forward([(r, seqs[r][-1:], True) for r in rows])
        assert batch.graphs.steps == steps_before + 1  # every decode-only step of <= 8 rows went the graph's way
        bucket = batch.last_plan.buckets[0]
        shapes.add((bucket.b, bucket.m))
        generations.add(batch.pool.generation)
        assert logits.shape[0] == len(rows) and bucket.b >= len(rows)
        for i, r in enumerate(rows):
            torch.testing.assert_close(logits[i], ref(torch.tensor([seqs[r]])).logits[0, -1], atol=ATOL, rtol=0)
            seqs[r].append(rng.randrange(3, 30))
    assert len(shapes) >= 3 and len(generations) >= 2  # several padded shapes; the pool grew meanwhile
    assert batch.pool.num_used == sum(len(b) for b in batch._blocks.values())  # padding rows own no block
    # more rows than the graphs take: the step runs eagerly, and still matches
    for _ in range(6):
        add(3)
    steps_before = batch.graphs.steps
    logits = batch.forward([(r, seqs[r][-1:], True) for r in seqs])
    assert batch.graphs.steps == steps_before and len(batch.last_plan.buckets) >= 1
    for i, r in enumerate(seqs):
        torch.testing.assert_close(logits[i], ref(torch.tensor([seqs[r]])).logits[0, -1], atol=ATOL, rtol=0)
    assert batch.graphs.drop() >= 1 and batch.graphs.drop() == 0


def _scheduler(model_dir, mode: str, composition: str = "mixed") -> Scheduler:
    model, tok = load(model_dir)
    return Scheduler(model, tok, max_running=16, max_total_tokens=4096, max_prefill_tokens=4096, seed=0,
                     chunked_prefill_size=32, block_size=8, cuda_graph=mode, cuda_graph_max_bs=16,
                     step_composition=composition)


def _greedy_run(s: Scheduler, prompts: list[list[int]], n: int) -> list[list[int]]:
    reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=n + 3 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        s._add(r)
        if i % 3 == 2:  # requests join while others decode
            s._admit()
            s._step()
    while not all(r.finished for r in reqs):
        s._drain_inbox()
        s._admit()
        s._step()
    return [r.output_ids for r in reqs]


def test_scheduler_greedy_tokens_are_the_same_with_the_static_graph_path(model_dir, ref):
    g = torch.Generator().manual_seed(5)
    prompts = [[1] + torch.randint(3, 30, (n,), generator=g).tolist() for n in (3, 40, 7, 19, 2, 66, 11)]
    eager = _greedy_run(_scheduler(model_dir, "off"), prompts, 20)
    s = _scheduler(model_dir, "static")
    static = _greedy_run(s, prompts, 20)
    assert static == eager
    assert static[1] == greedy_reference(ref, prompts[1], 23)
    assert s.batch.graphs.steps >= 20 and s.stats.decode_steps >= 20
    # the counters see the padded shape: one bucket per graph step, padded rows x blocks gathered
    assert s.stats.decode_buckets == s.stats.decode_steps
    assert s.stats.decode_padded >= s.stats.decode_ctx_tokens


def test_separate_forwards_replay_every_decode_step_with_the_same_greedy_tokens(model_dir, ref):
    """SGLang's default composition (the GPU's)."""
    g = torch.Generator().manual_seed(7)
    prompts = [[1] + torch.randint(3, 30, (n,), generator=g).tolist() for n in (3, 40, 7, 19, 2, 66, 11)]
    mixed = _scheduler(model_dir, "static", "mixed")
    tokens_mixed = _greedy_run(mixed, prompts, 20)
    assert mixed.stats.prefill_decode_steps > 0  # the workload does overlap prefill with decoding rows
    assert mixed.batch.graphs.steps < mixed.stats.decode_steps + mixed.stats.prefill_decode_steps
    separate = _scheduler(model_dir, "static", "separate")
    tokens_separate = _greedy_run(separate, prompts, 20)
    assert tokens_separate == tokens_mixed
    assert tokens_separate[5] == greedy_reference(ref, prompts[5], 35)
    st = separate.stats
    assert st.prefills > 0 and st.prefill_decode_steps == st.prefill_decode_rows == 0  # no forward mixes them
    # every forward that decoded replayed the graph path; the decode rows of the steps that also prefilled are in it
    assert separate.batch.graphs.steps == st.decode_steps > mixed.stats.decode_steps
    with pytest.raises(ValueError, match="step_composition"):
        _scheduler(model_dir, "off", "interleaved")


@torch.no_grad()
def test_a_step_whose_capture_fails_runs_eagerly_and_so_do_the_later_ones(model_dir, ref, monkeypatch, caplog):
    """An op a CUDA graph capture refuses does not fail the step."""
    from slime.backends.hf_engine import decode_graphs

    batch = PagedBatch(load(model_dir)[0], block_size=4, max_tokens=1024, max_rows=8, decode_graphs="static")
    batch.graphs.mode = "capture"  # as on a GPU; the capture itself fails here

    def refuse(self, shape):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "_capture", refuse)
    seq = [1, 5, 6, 7, 8, 9]
    row = batch.add_row()
    batch.forward([(row, seq[:-1], False)])
    with caplog.at_level("ERROR"):
        logits = batch.forward([(row, seq[-1:], True)])
    torch.testing.assert_close(logits[0], ref(torch.tensor([seq])).logits[0, -1], atol=ATOL, rtol=0)
    assert batch.graphs.mode == "off" and "capture failed" in batch.graphs.describe() and "capture failed" in caplog.text
    seq.append(3)
    logits = batch.forward([(row, seq[-1:], True)])
    torch.testing.assert_close(logits[0], ref(torch.tensor([seq])).logits[0, -1], atol=ATOL, rtol=0)
    assert batch.graphs.steps == 0
