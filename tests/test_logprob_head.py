"""The chunked log-prob / entropy head (training_utils.logprob_head) against log_softmax over the full logits."""

from __future__ import annotations

import os

import pytest
import torch

from slime.backends.training_utils.logprob_head import chunk_tokens, head_log_probs
from slime.backends.training_utils.varlen import kernel_name, packed_causal_attention
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs

torch.set_num_threads(1)
N, H, V = 45, 24, 203


def inputs(seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(vocab, H, generator=g) * 0.5
    t = torch.randint(0, vocab, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return h, w, t, g_lp, g_ent


def reference(h, w, t, temperature, g_lp, g_ent, real=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = h @ w.t()
    if real is not None:
        logits = logits[:, :real]
    lp = compute_log_probs(logits, t, temperature)
    ent = compute_entropy_from_logits(logits, temperature)
    (lp * g_lp + ent * g_ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, 0, -1])
def test_values_and_gradients_equal_the_full_logits_path(temperature, chunk):
    h, w, t, g_lp, g_ent = inputs()
    lp0, ent0, gh0, gw0 = reference(h, w, t, temperature, g_lp, g_ent)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = head_log_probs(hh, ww, t, temperature, chunk_size=chunk, with_entropy=True, entropy_grad=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    assert (lp - lp0).abs().max() <= 1e-5 and (ent - ent0).abs().max() <= 1e-5
    assert (hh.grad - gh0).abs().max() <= 1e-5 and (ww.grad - gw0).abs().max() <= 1e-5


def test_entropy_without_gradient_and_padded_vocabulary_rows():
    h, w, t, g_lp, _ = inputs(seed=1)
    real = V - 11  # the last 11 rows are padding: they never get probability, nor a gradient
    t = t.clamp(max=real - 1)
    lp0, ent0, gh0, gw0 = reference(h, w, t, 1.0, g_lp, torch.zeros(N), real=real)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = head_log_probs(hh, ww, t, 1.0, vocab_size=real, chunk_size=5, with_entropy=True, entropy_grad=False)
    assert not ent.requires_grad and (ent - ent0).abs().max() <= 1e-5
    (lp * g_lp).sum().backward()
    assert (lp - lp0).abs().max() <= 1e-5 and (hh.grad - gh0).abs().max() <= 1e-5
    assert (ww.grad - gw0).abs().max() <= 1e-5 and torch.equal(ww.grad[real:], torch.zeros(11, H))


def test_auto_chunk_holds_a_bounded_number_of_logits():
    cpu = torch.device("cpu")
    assert chunk_tokens(0, 151936, cpu) * 151936 <= 1 << 24 and chunk_tokens(0, 151936, cpu) >= 100
    assert chunk_tokens(64, 151936, cpu) == 64 and chunk_tokens(-1, 10, cpu) > 1 << 40
    with pytest.raises(ValueError, match="--log-probs-chunk-size"):
        chunk_tokens(-2, 10, cpu)


def _vocab_parallel_rank(rank, world, out_dir, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        h, w, t, g_lp, g_ent = inputs(seed=2)
        real = V - 3
        per = -(-V // world)  # rows per rank; the last rank holds the padding
        w = torch.cat([w, torch.zeros(per * world - V, H)])
        local = w[rank * per : (rank + 1) * per].clone().requires_grad_()
        hh = h.clone().requires_grad_()
        lp, ent = head_log_probs(hh, local, t.clamp(max=real - 1), 0.8, vocab_size=real, vocab_start=rank * per,
                                 chunk_size=6, tp_group=dist.group.WORLD, with_entropy=True, entropy_grad=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        grad_h = hh.grad.clone()
        dist.all_reduce(grad_h)  # each rank holds its vocabulary part of the hidden states' gradient
        torch.save({"lp": lp, "ent": ent, "gh": grad_h, "gw": local.grad}, os.path.join(out_dir, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_over_two_ranks_equals_one(tmp_path):
    from megatron_helpers import free_port, spawn

    spawn(_vocab_parallel_rank, 2, str(tmp_path), free_port(), timeout=120)
    h, w, t, g_lp, g_ent = inputs(seed=2)
    real = V - 3
    lp0, ent0, gh0, gw0 = reference(h, w, t.clamp(max=real - 1), 0.8, g_lp, g_ent, real=real)
    parts = [torch.load(tmp_path / f"r{r}.pt") for r in range(2)]
    for p in parts:
        assert (p["lp"] - lp0).abs().max() <= 1e-5 and (p["ent"] - ent0).abs().max() <= 1e-5
        assert (p["gh"] - gh0).abs().max() <= 1e-5
    gw = torch.cat([p["gw"] for p in parts])[:V]
    assert (gw - gw0).abs().max() <= 1e-5 and torch.equal(gw[real:], torch.zeros(V - real, H))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_packed_attention_equals_padded_causal_sdpa(heads):
    import torch.nn.functional as F

    hq, hkv = heads
    lengths = [5, 1, 9, 3]
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randn(n, hq, 8, generator=g), torch.randn(n, hkv, 8, generator=g), torch.randn(n, hkv, 8, generator=g))
            for n in lengths]
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    assert kernel_name(q) == "per_sample_sdpa"
    out = packed_causal_attention(q, k, v, cu, max(lengths), scale=0.3)
    width = max(lengths)
    pad = lambda x: torch.stack([torch.cat([s, s.new_zeros(width - len(s), *s.shape[1:])]) for s in x])  # noqa: E731
    qp, kp, vp = (pad([s[i] for s in seqs]).transpose(1, 2) for i in range(3))  # [B, H, S, D]
    ref = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=0.3, enable_gqa=hq != hkv).transpose(1, 2)
    want = torch.cat([ref[i, :n] for i, n in enumerate(lengths)])
    assert (out - want).abs().max() <= 1e-5


def test_varlen_kernel_probe_refuses_a_kernel_that_does_not_run(caplog):
    """torch's varlen kernel is CUDA-only."""
    from slime.backends.training_utils.varlen import _torch_varlen, _torch_varlen_works

    if _torch_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    with torch.no_grad():
        assert _torch_varlen_works(torch.device("cpu"), torch.bfloat16) is False
    assert "packed attention uses one SDPA call per sample" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_varlen_kernel_matches_per_sample_attention():
    lengths = [300, 17, 1024, 5]
    total = sum(lengths)
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    assert kernel_name(q) in ("flash_attn_varlen", "torch_varlen")
    fast = packed_causal_attention(q, k, v, cu, max(lengths))
    slow = packed_causal_attention(q.float(), k.float(), v.float(), cu, max(lengths))  # per sample, fp32
    assert (fast.float() - slow).abs().max() < 2e-2


@pytest.mark.slow  # inductor compiles C++ kernels on a CPU: ~30 s on a fresh machine
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_kernels_give_the_eager_heads_values_and_gradients(temperature):
    """--compile-ops: the fused head gives the full-logits values and gradients within 1e-5 (float32)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, w, t, g_lp, g_ent = (x.to(dev) for x in inputs(seed=3))
    real = V - 5
    t = t.clamp(max=real - 1)
    lp0, ent0, gh0, gw0 = reference(h, w, t, temperature, g_lp, g_ent, real=real)
    for entropy_grad in (True, False):
        got = {}
        for fused in (False, True):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = head_log_probs(hh, ww, t, temperature, vocab_size=real, chunk_size=7, with_entropy=True,
                                     entropy_grad=entropy_grad, fused=fused)
            (lp * g_lp + (ent * g_ent if entropy_grad else 0)).sum().backward()
            got[fused] = (lp.detach(), ent.detach(), hh.grad, ww.grad)
        assert (got[True][0] - lp0).abs().max() <= 1e-5 and (got[True][1] - ent0).abs().max() <= 1e-5
        if entropy_grad:
            assert (got[True][2] - gh0).abs().max() <= 1e-5 and (got[True][3] - gw0).abs().max() <= 1e-5
        for a, b in zip(got[True], got[False]):
            assert (a - b).abs().max() <= 1e-5
        assert torch.equal(got[True][3][real:], torch.zeros(5, H, device=dev))
