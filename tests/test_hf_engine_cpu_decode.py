"""The CPU decode-attention kernel against torch's gather + SDPA, and the engine's packed steps with and without it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from slime.backends.hf_engine import cpu_decode

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def reference(q, kv, table, last, scale):
    """gather + masked SDPA, as paged_attention's torch path: q [b, Hq, D] -> [b, Hq, D]."""
    b, hq, d = q.shape
    hkv, bs = kv.shape[1], kv.shape[3]
    m = table.shape[1]
    g = kv.index_select(2, table.reshape(-1)).view(2, hkv, b, m * bs, d)
    mask = (torch.arange(m * bs)[None, :] <= last[:, None])[None, :, None, :]
    qq = q.reshape(b, hkv, hq // hkv, d).transpose(0, 1)
    return F.scaled_dot_product_attention(qq, g[0], g[1], attn_mask=mask, scale=scale).transpose(0, 1).reshape(b, hq, d)


@pytest.mark.parametrize("hq,hkv,d,bs,threads", [(9, 3, 64, 32, 1), (9, 3, 64, 32, 2), (4, 2, 128, 16, 2),
                                                 (4, 4, 32, 4, 1), (8, 2, 16, 8, 2)])
def test_kernel_matches_gather_and_sdpa(hq, hkv, d, bs, threads):
    kernel = cpu_decode.load()
    assert kernel is not None
    gen = torch.Generator().manual_seed(hq * d + bs)
    b, m, nb = 13, 5, 80
    kv = torch.randn(2, hkv, nb, bs, d, generator=gen)
    table = torch.randperm(nb - 1, generator=gen)[: b * m].add(1).view(b, m)
    last = torch.randint(0, m * bs, (b,), generator=gen)
    last[0], last[1] = 0, m * bs - 1  # one key only; every block full
    for r in range(b):  # blocks past a row's keys are never read: poison them
        kv[:, :, table[r, int(last[r]) // bs + 1:]] = float("nan")
    q = torch.randn(hq, b, d, generator=gen).transpose(0, 1)  # strided, as the step's packed queries are
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(q, kv, table, last.unsqueeze(1), 0.125)
    finally:
        torch.set_num_threads(before)
    kv = torch.nan_to_num(kv, nan=0.0)  # the reference gathers (and masks) the poisoned blocks too
    want = reference(q, kv, table, last, 0.125)
    assert got is not None and torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5


def test_kernel_declines_what_it_does_not_take():
    kernel = cpu_decode.load()
    kv = torch.randn(2, 1, 4, 4, 8)
    table, last = torch.tensor([[1]]), torch.tensor([[2]])
    assert kernel(torch.randn(1, 1, 8, dtype=torch.float64), kv, table, last, 1.0) is None
    assert kernel(torch.randn(1, 32, 8), torch.randn(2, 1, 4, 4, 8), table, last, 1.0) is None  # 32 heads per KV head


def test_without_a_compiler_the_engine_keeps_the_torch_path(caplog):
    with caplog.at_level("INFO"):
        assert cpu_decode.load("no-such-compiler-here") is None
    assert "torch path" in caplog.text


def test_engine_steps_with_and_without_the_kernel_agree(tmp_path):
    from transformers import AutoModelForCausalLM

    from slime.backends.hf_engine.batch import PagedBatch
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=512)
    build_tiny_qwen3(str(tmp_path), build_tokenizer([str(i) for i in range(10)]), spec, seed=3)
    logits = {}
    for use in (True, False):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
        batch = PagedBatch(model, block_size=8)
        assert batch.decode_kernel is not None
        if not use:
            batch.decode_kernel = None
        rows = [batch.add_row() for _ in range(3)]
        gen = torch.Generator().manual_seed(0)
        out = [batch.forward([(r, torch.randint(3, 13, (n,), generator=gen).tolist(), True)
                              for r, n in zip(rows, (5, 17, 30))])]
        for _ in range(12):
            out.append(batch.forward([(r, [int(torch.randint(3, 13, (1,), generator=gen))], True) for r in rows]))
        logits[use] = torch.stack(out)
    assert (logits[True] - logits[False]).abs().max() < 1e-4
