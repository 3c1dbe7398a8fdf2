"""The engine's RMSNorm layers as torch's rms_norm (hf_engine/fused_norms.py)."""

from __future__ import annotations

import pytest
import torch

from slime.backends.hf_engine import fused_norms
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fused_norm_model")
    build_tiny_qwen3(str(d), build_tokenizer(list("abcdefghij")), SPEC, seed=0)
    return d


def load(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()


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
