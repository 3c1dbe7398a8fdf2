"""The Megatron trainer on CUDA (skipped without a GPU; no Ray needed)."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from megatron_helpers import full_logits
from test_fsdp_helpers import make_groups

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def qwen3_half_b(tmp_path_factory):
    """A random Qwen3 of ~0.5B parameters (bf16 on disk, as real checkpoints)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.utils.tiny_model import build_tokenizer

    d = tmp_path_factory.mktemp("qwen3_05b")
    tok = build_tokenizer(list("0123456789+-="))
    cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      max_position_embeddings=4096, rope_theta=1000000.0, dtype="bfloat16",
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):  # seconds, not the CPU's tens of seconds
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture
def trainer(make_trainer, qwen3_half_b):
    """`trainer(*argv, **over)`: a bf16 Megatron trainer on the 0.5B model (conftest's make_trainer)."""
    return lambda *argv, **over: make_trainer("megatron", "--bf16", *argv, model_dir=qwen3_half_b, **over)


def test_bf16_logits_match_transformers(trainer, qwen3_half_b):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 151000, (2, 64), device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(qwen3_half_b, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        want = hf(input_ids=ids).logits.float()
    got = full_logits(trainer(), ids)
    assert got.is_cuda
    # bf16: compare distributions, not bits
    p, q = torch.log_softmax(want, -1), torch.log_softmax(got, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert kl < 1e-2, kl
    assert float((want.argmax(-1) == got.argmax(-1)).float().mean()) > 0.9


def test_tp1_training_steps_and_time_per_step(trainer, tmp_path):
    t = trainer("--use-distributed-optimizer", lr=1e-5, micro_batch_size=4)
    groups = make_groups(n_groups=8, group_size=8, seed=1)
    t.train(0, copy.deepcopy(groups), 0)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = [t.train(i, copy.deepcopy(groups), i) for i in range(1, 4)]
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / 3
    print(f"\n~0.5B Qwen3, bf16, TP=1, 64 samples/step: {per_step:.3f} s per step")
    assert all(m["grad_norm"] > 0 and m["loss"] == m["loss"] for m in metrics)
    t.save(str(tmp_path / "ckpt"))


def test_conversion_round_trip_on_gpu(qwen3_half_b, tmp_path):
    from safetensors.torch import load_file

    from slime.arguments import megatron_flags
    from slime.backends.megatron_utils.convert import hf_to_torch_dist, torch_dist_to_hf

    hf_to_torch_dist(megatron_flags(["--bf16"]), qwen3_half_b, str(tmp_path / "td"))
    torch_dist_to_hf(megatron_flags(), str(tmp_path / "td"), str(tmp_path / "hf"), qwen3_half_b)
    before = load_file(f"{qwen3_half_b}/model.safetensors")
    after = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[k], after[k]) for k in before)
