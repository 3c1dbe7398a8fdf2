"""--offload: the trainer's state leaves the device and comes back bit-identical, on both backends."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_helpers import megatron_args
from test_fsdp_helpers import make_args, make_groups

from slime.backends.training_utils.offload import DeviceOffloader, _local

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)


@pytest.fixture
def trainer(make_trainer):
    """A trainer of either backend with a KL loss (so the reference model's state is offloaded too)."""
    return lambda backend, *argv, **over: make_trainer(backend, "--use-kl-loss", "--kl-loss-coef", "0.1", *argv, **over)


def snapshot(trainer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, a copy of its values) for every state tensor, in the trainer's order."""
    return [(t, _local(t).detach().clone()) for t in trainer._state_tensors()]


def fill_grads(trainer, backend):
    """Leave non-zero gradients in place (as between a backward and the next zero_grad)."""
    items, rt, _ = trainer._prepare(copy.deepcopy(make_groups(seed=7)))
    trainer._accumulate_grads(items, rt)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_offload_round_trip_is_exact_and_frees_every_storage(trainer, backend, tmp_path):
    t = trainer(backend)
    t.train(0, make_groups(seed=1), 0)  # optimizer state exists
    fill_grads(t, backend)
    before = snapshot(t)
    kinds = {"grads": 0, "optimizer": 0}
    if backend == "fsdp":
        kinds["grads"] = sum(p.grad is not None for p in t.model.parameters())
        kinds["optimizer"] = len(t.optimizer.state)
    else:
        kinds["grads"] = sum("main_grad" in p.__dict__ for p in t.actor.model.parameters())
        kinds["optimizer"] = sum(len(o.state) for o in __import__(
            "slime.backends.megatron_utils.actor", fromlist=["x"]).megatron_inner_optimizers(t.optimizer))
    assert kinds["grads"] > 0 and kinds["optimizer"] > 0, kinds
    assert any(v.abs().sum() > 0 for _, v in before)

    stats = t.offload()
    assert t.offloaded and stats["offload_bytes"] > 0 and stats["offload_storages"] >= 3
    assert all(_local(x).untyped_storage().nbytes() == 0 for x, _ in before)  # freed for real
    with pytest.raises(RuntimeError, match="twice"):
        t.offload()

    t.save(str(tmp_path / "ckpt"))  # comes back for the save, and leaves again
    assert t.offloaded and all(_local(x).untyped_storage().nbytes() == 0 for x, _ in before)

    assert t.onload()["onload_bytes"] == stats["offload_bytes"]
    for x, v in before:
        assert torch.equal(_local(x), v)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_training_through_offload_equals_training_without(trainer, backend):
    plain, moved = trainer(backend), trainer(backend)
    m_plain, m_moved = {}, {}
    for step in range(2):
        groups = make_groups(seed=10 + step)
        moved.offload()
        moved.onload()
        m_plain = plain.train(step, copy.deepcopy(groups), step)
        m_moved = moved.train(step, copy.deepcopy(groups), step)
    assert m_plain["loss"] == m_moved["loss"]
    for (a, va), (b, vb) in zip(snapshot(plain), snapshot(moved)):
        assert torch.equal(va, vb)


def test_offloader_dedupes_views_and_tied_storage():
    base = torch.arange(12.0)
    view, other = base[3:7], torch.ones(5)
    off = DeviceOffloader("test")
    stats = off.offload([base, view, other, view])
    assert stats["offload_storages"] == 2 and stats["offload_bytes"] == 12 * 4 + 5 * 4
    assert base.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(base, torch.arange(12.0)) and torch.equal(view, torch.arange(3.0, 7.0))
    assert torch.equal(other, torch.ones(5))
    with pytest.raises(RuntimeError, match="without an offload"):
        off.onload()


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    """A random Qwen3 of ~60M parameters."""
    import json
    import os

    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.utils.tiny_model import build_tokenizer
    from test_fsdp_helpers import WORDS

    d = tmp_path_factory.mktemp("qwen3_60m")
    tok = build_tokenizer(WORDS)
    cfg = Qwen3Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    return str(d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_cuda_offload_frees_most_of_the_trainers_memory(mid_model_dir, backend):
    """The trainer's own allocation leaves the GPU, and the driver gets it back."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    baseline, baseline_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    if backend == "fsdp":
        from slime.backends.fsdp_utils.actor import FSDPTrainer

        t = FSDPTrainer(make_args(mid_model_dir, "--train-backend", "fsdp"))
    else:
        from slime.backends.megatron_utils.actor import MegatronTrainer

        t = MegatronTrainer(megatron_args(mid_model_dir))
    t.init()
    try:
        t.train(0, make_groups(seed=1, vocab=32000), 0)
        stats = t.offload()
        own = stats["allocated_before"] - baseline
        assert own > 512 * 2**20, stats  # weights, gradients, Adam: ~1 GB
        assert stats["offload_bytes"] >= 0.85 * own, stats
        # what stays: cuBLAS's workspace and small buffers (RoPE caches, RNG state)
        assert stats["allocated_after"] - baseline <= 0.1 * own, stats
        assert stats["reserved_after"] - baseline_reserved <= 0.2 * own, (stats, baseline_reserved)
        t.onload()
        t.train(1, make_groups(seed=2, vocab=32000), 1)
    finally:
        t.shutdown()
    gc.collect()
    assert torch.cuda.memory_allocated() - baseline < 0.1 * own  # shutdown gives the trainer's memory back
