"""The engine's RMSNorm layers as torch's rms_norm (hf_engine/fused_norms.py) and its linear layers on oneDNN
(hf_engine/onednn_linear.py)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.hf_engine import fused_norms, onednn_linear
from hf_engine_reference import load_model as load, tiny_model, tiny_spec

SPEC = tiny_spec()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory, "fused_norm_model", seed=0, words=list("abcdefghij"))[0]


@torch.no_grad()
def test_fused_norms_give_the_modules_logits(model_dir):
    ref, fused = load(model_dir), load(model_dir)
    n = fused_norms.fuse_rms_norms(fused)
    assert n == SPEC.num_hidden_layers * 4 + 1  # input, post-attention, q and k norms per layer, and the final one
    assert all("forward" in m.__dict__ for m in fused.modules() if type(m).__name__ == "Qwen3RMSNorm")
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 3]])
    assert torch.equal(fused(ids).logits, ref(ids).logits)  # float32 on the CPU: the same arithmetic
    ref16, fused16 = load(model_dir, torch.bfloat16), load(model_dir, torch.bfloat16)
    assert fused_norms.fuse_rms_norms(fused16) == n
    torch.testing.assert_close(fused16(ids).logits.float(), ref16(ids).logits.float(), atol=0.1, rtol=0.05)


def test_a_disagreeing_rms_norm_is_not_used(model_dir, monkeypatch, caplog):
    model = load(model_dir)
    monkeypatch.setattr(fused_norms.F, "rms_norm", lambda x, shape, w, eps: x * 2)
    with caplog.at_level("WARNING"):
        assert fused_norms.fuse_rms_norms(model) == 0
    assert "kept transformers' modules" in caplog.text and "relative difference" in caplog.text
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_only_standard_rms_norms_are_swapped():
    class GemmaRMSNorm(torch.nn.Module):  # weight offset by 1: not the standard formula
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = GemmaRMSNorm()

    assert fused_norms.fuse_rms_norms(Model()) == 0


@torch.no_grad()
def test_onednn_linears_give_f_linears_logits_and_see_weight_updates(model_dir, monkeypatch, caplog):
    ref, model = load(model_dir), load(model_dir)
    n = onednn_linear.use_onednn_linears(model)
    if not torch.backends.mkldnn.is_available():
        assert n == 0
        return
    assert n == 7 * SPEC.num_hidden_layers + 1  # q, k, v, o, gate, up, down per layer, and the head
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 4, 3]])
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    for m in (ref, model):  # a weight update writes the parameters in place: the next forward sees it
        m.lm_head.weight.data.mul_(0.5)
    torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(onednn_linear.torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *a: x @ w.t() * 2)
    with caplog.at_level("WARNING"):
        assert onednn_linear.use_onednn_linears(load(model_dir)) == 0
    assert "F.linear kept" in caplog.text
