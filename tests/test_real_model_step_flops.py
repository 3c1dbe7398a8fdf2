"""benchmarks/real_model_step.py's FLOP count: its body and head terms are the model's matmul weights."""

from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from real_model_step import ModelShape  # noqa: E402


def test_the_flop_terms_are_the_models_matmul_weights(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                      num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    shape = ModelShape(str(tmp_path))
    assert shape.body == layers and shape.head == 300 * 48
    assert shape.attn_per_key == 4 * 3 * 6 * 8
    # a decoded row: body and head once, attention over its cached keys and its own
    assert shape.decode_flops(rows=2, ctx_tokens=10) == 2 * 2 * (layers + 300 * 48) + 4 * 3 * 6 * 8 * 12
    # training: 3 forwards (forward, backward), 4 with an old-log-prob forward; the head on response tokens only
    fwd = shape.train_flops(tokens=20, response_tokens=8, samples=2, old_forward=False) / 3
    assert fwd == 2 * layers * 20 + 2 * 300 * 48 * 8 + 4 * 3 * 6 * 8 * 2 * 10 * 11 / 2
    assert shape.train_flops(20, 8, 2, True) == 4 * fwd
