"""The scheduler's steps, driven by hand (no thread, no HTTP)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.hf_engine.sampling import SamplingParams
from slime.backends.hf_engine.scheduler import Request, Scheduler
from hf_engine_reference import WORDS, greedy_reference, load_model, tiny_model, tiny_spec



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "sched_model", seed=1, spec=tiny_spec(512))[0]


def load(model_dir):
    from transformers import AutoTokenizer

    return load_model(model_dir), AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def ref(model_dir):
    return load(model_dir)[0]


def scheduler(model_dir, **kw) -> Scheduler:
    model, tok = load(model_dir)
    opts = dict(max_running=8, max_total_tokens=4096, max_prefill_tokens=4096, seed=0, chunked_prefill_size=32,
                block_size=8)
    opts.update(kw)
    return Scheduler(model, tok, **opts)


def request(rid: str, prompt: list[int], n: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))


def step(s: Scheduler) -> None:
    s._drain_inbox()
    s._admit()
    s._step()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, len(WORDS) + 3, (n - 1,), generator=g).tolist()


def test_long_prompt_is_prefilled_in_chunks_while_the_batch_keeps_decoding(model_dir, ref):
    s = scheduler(model_dir)
    short = request("short", prompt(5, 0), 40)
    s._add(short)
    for _ in range(3):
        step(s)
    assert len(short.output_ids) == 3
    long = request("long", prompt(200, 1), 6)
    s._add(long)
    for i in range(7):  # 200 tokens in chunks of 32: the first token comes with the 7th chunk
        step(s)
        assert len(short.output_ids) == 4 + i  # the short row decoded at every one of these steps
        assert len(long.output_ids) == (1 if i == 6 else 0)
    assert s.stats.prefills == 7 + 1 and s.stats.prefill_rows == 7 + 1  # (+ the short prompt's own step)
    assert s.stats.requests_in == 2
    # one decoding row: one attention bucket in each step that decoded (what the simulator's bucket term counts)
    assert s.stats.decode_buckets == s.stats.decode_steps == 3 - 1
    assert s.stats.prefill_decode_buckets == s.stats.prefill_decode_steps == 7
    while not (short.finished and long.finished):
        step(s)
    assert short.output_ids == greedy_reference(ref, short.input_ids, 40)
    assert long.output_ids == greedy_reference(ref, long.input_ids, 6)
    assert s.batch.pool.num_used == 0 and s.batch.num_rows == 0  # finished rows gave their blocks back


def test_abort_mid_prefill_keeps_the_computed_part_and_the_resume_continues_it(model_dir, ref):
    s = scheduler(model_dir)
    p = prompt(150, 2)
    r = request("r", p, 10)
    s._add(r)
    step(s)
    step(s)  # 64 of 150 positions prefilled
    assert s.batch.cached(r.row) == 64
    assert s.abort("r") == 1 and r.finish_reason["type"] == "abort" and r.output_ids == []
    assert len(s.prefix_cache) == 1
    again = request("r2", p, 10)  # resumed with exactly the aborted request's tokens
    s._add(again)
    while not again.finished:
        step(s)
    assert again.cached_tokens == 64 and s.stats.cache_hit_tokens == 64
    assert again.output_ids == greedy_reference(ref, p, 10)


def test_abort_while_decoding_then_resume_prefills_nothing(model_dir, ref):
    s = scheduler(model_dir)
    p = prompt(40, 3)
    r = request("r", p, 30)
    s._add(r)
    for _ in range(8):
        step(s)
    s.abort("r")
    part = list(r.output_ids)
    resumed = request("r2", p + part, 30 - len(part))
    s._add(resumed)
    prefilled = s.stats.prefill_tokens
    while not resumed.finished:
        step(s)
    assert s.stats.prefill_tokens == prefilled  # joined on its cached KV: its last token was its first segment
    assert resumed.cached_tokens == len(p) + len(part) - 1
    assert part + resumed.output_ids == greedy_reference(ref, p, 30)


def test_prefix_cache_gives_blocks_back_when_running_rows_need_them(model_dir, ref):
    """The cached KV of aborted requests lives in the same pool as the running rows'."""
    s = scheduler(model_dir, max_total_tokens=160, max_running=2)  # 20 blocks of 8 (+ 2 for partial blocks)
    a, b = prompt(60, 4), prompt(60, 5)
    for rid, p in (("a", a), ("b", b)):
        s._add(request(rid, p, 20))
    for _ in range(4):
        step(s)
    s.abort(None)
    assert len(s.prefix_cache) == 2 and s.batch.pool.num_used == 16  # 2 x 63 positions cached
    c = request("c", prompt(100, 6), 40)  # needs 18 of the 22 usable blocks: both cached entries must go
    s._add(c)
    while not c.finished:
        step(s)
    assert len(s.prefix_cache) == 0
    assert c.output_ids == greedy_reference(ref, c.input_ids, 40)
    again = request("a2", a, 5)
    s._add(again)
    while not again.finished:
        step(s)
    assert again.cached_tokens == 0 and again.output_ids == greedy_reference(ref, a, 5)


def test_retract_recomputes_from_tokens(model_dir, ref):
    s = scheduler(model_dir)
    r = request("r", prompt(20, 7), 25)
    s._add(r)
    for _ in range(6):
        step(s)
    assert s.retract() == 1 and s.batch.pool.num_used == 0
    while not r.finished:
        step(s)
    assert r.output_ids == greedy_reference(ref, r.input_ids, 25)


def sampled(rid: str, p: list[int], n: int, seed: int, **over) -> Request:
    g = torch.Generator().manual_seed(seed)
    return Request(rid, list(p), SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, **over),
                   generator=g)


def run_group(s: Scheduler, p: list[int], n: int, size: int) -> list[Request]:
    reqs = [sampled(f"g{i}", p, n, seed=i) for i in range(size)]
    for r in reqs:
        s._add(r)
    while not all(r.finished for r in reqs):
        step(s)
    return reqs


@pytest.mark.parametrize("length", [37, 41])  # the shared positions end inside a block, or at its end
def test_a_groups_samples_share_their_prompts_kv(model_dir, ref, length):
    """The samples of a group (one prompt, n requests)."""
    p = prompt(length, 9)
    shared = scheduler(model_dir)
    own = scheduler(model_dir, prefix_cache_tokens=0)
    a, b = run_group(shared, p, 12, 4), run_group(own, p, 12, 4)
    assert shared.stats.prefill_tokens == length and own.stats.prefill_tokens == 4 * length
    assert shared.stats.shared_prompts == 3 and shared.stats.shared_prompt_tokens == 3 * (length - 1)
    assert [r.cached_tokens for r in a] == [0] + [length - 1] * 3 and [r.cached_tokens for r in b] == [0] * 4
    for x, y in zip(a, b):
        assert x.output_ids == y.output_ids
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
    assert len({tuple(r.output_ids) for r in a}) > 1  # sampled apart after the shared prompt
    assert shared.batch.pool.num_used == 0 and shared.batch.num_rows == 0
    g = [request(f"q{i}", p, 8) for i in range(3)]
    for r in g:
        shared._add(r)
    while not all(r.finished for r in g):
        step(shared)
    assert all(r.output_ids == greedy_reference(ref, p, 8) for r in g)
    assert shared.batch.pool.num_used == 0


def test_a_follower_whose_leader_is_aborted_prefills_its_own_prompt(model_dir, ref):
    s = scheduler(model_dir, chunked_prefill_size=16)
    p = prompt(60, 10)
    lead, follow = request("lead", p, 6), request("follow", p, 6)
    s._add(lead)
    s._add(follow)
    step(s)  # the leader's first chunk; the follower waits
    assert follow.leader is lead and s.batch.cached(follow.row) == 0
    s.abort("lead")
    while not follow.finished:
        step(s)
    assert follow.cached_tokens == 0 and follow.output_ids == greedy_reference(ref, p, 6)
    assert s.stats.shared_prompts == 0


def test_only_requests_of_one_extra_key_share_a_prompt(model_dir):
    s = scheduler(model_dir)
    p = prompt(30, 11)
    reqs = [sampled("a", p, 4, 0), sampled("b", p, 4, 1), sampled("c", p, 4, 2)]
    reqs[1].extra_key = "v1"
    for r in reqs:
        s._add(r)
    while not all(r.finished for r in reqs):
        step(s)
    assert [r.cached_tokens for r in reqs] == [0, 0, 29] and s.stats.shared_prompts == 1
