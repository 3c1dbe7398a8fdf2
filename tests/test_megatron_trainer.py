"""The Megatron trainer's own features at world size 1, in-process (gloo, CPU shim)."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_helpers import full_weights, megatron_args
from test_fsdp_helpers import make_args, make_groups, make_model_dir, model_log_probs, reference_log_probs

from slime.backends.training_utils.data import flatten_groups

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)


def hf_weights_of(trainer) -> dict[str, torch.Tensor]:
    from slime.backends.megatron_utils.update_weight import gather_hf_weights

    return dict(gather_hf_weights(trainer.actor, trainer.layout))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))
    # on a GPU, FSDP's full state dict comes to the CPU while Megatron's gathered weights stay on the device
    return max(float((a[k].cpu() - b[k].cpu()).abs().max()) for k in a)


@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_one_rl_step_equals_fsdp(tiny_model_dir, make_trainer, estimator):
    """Same flags, same batch: FSDP and Megatron report the same loss and end with the same weights."""
    from slime.backends.fsdp_utils.actor import FSDPTrainer
    from slime.backends.fsdp_utils.hf_weights import full_state_dict

    over = dict(lr=1e-2, use_tis=True, advantage_estimator=estimator, eps_clip_high=0.28, micro_batch_size=3)
    groups = make_groups(seed=31)
    for g in groups:  # off-policy behaviour log-probs: TIS weights != 1
        for s in g:
            s.rollout_log_probs = [-0.4 * (i % 3) - 1.5 for i in range(s.response_length)]
    fsdp = FSDPTrainer(make_args(tiny_model_dir, **over))
    fsdp.init()
    m_fsdp = fsdp.train(0, copy.deepcopy(groups), 0)
    w_fsdp = {k: v.clone() for k, v in full_state_dict(fsdp.model).items()}
    fsdp.shutdown()

    meg = make_trainer("megatron", **over)
    w0 = hf_weights_of(meg)
    m_meg = meg.train(0, copy.deepcopy(groups), 0)
    w_meg = hf_weights_of(meg)
    for key in ("loss", "pg_loss", "pg_clipfrac", "entropy", "tis_ess", "logprob_abs_diff_max"):
        assert m_meg[key] == pytest.approx(m_fsdp[key], abs=1e-5), key
    assert m_meg["grad_norm"] == pytest.approx(m_fsdp["grad_norm"], rel=1e-5)
    assert max_diff(w_meg, w_fsdp) <= 1e-5
    assert max_diff(w_meg, w0) > 1e-3  # the step moved the weights


def test_the_pad_tokens_embedding_row_learns_as_in_transformers(make_trainer, tiny_model_dir):
    """transformers builds the embedding as nn.Embedding(padding_idx=pad_token_id)."""
    from slime.backends.fsdp_utils.hf_weights import full_state_dict
    from slime.utils.model_shape import read_shape

    pad = read_shape(tiny_model_dir).pad_token_id
    assert pad is not None
    groups = make_groups(seed=17)
    for s in [s for g in groups for s in g]:
        s.tokens[1] = s.tokens[-1] = pad  # in the prompt and as the response's last token
    over = dict(lr=1e3, adam_eps=1e3, clip_grad=0.0)  # Adam's first step ~ the gradient itself
    updates = {}
    for backend in ("fsdp", "megatron"):
        t = make_trainer(backend, **over)
        weights = (lambda: {k: v.clone() for k, v in full_state_dict(t.model).items()}) if backend == "fsdp" \
            else (lambda: hf_weights_of(t))
        w0 = weights()
        t.train(0, copy.deepcopy(groups), 0)
        updates[backend] = {k: w0[k] - v for k, v in weights().items()}
        t.shutdown()
    fsdp, meg = updates["fsdp"]["model.embed_tokens.weight"], updates["megatron"]["model.embed_tokens.weight"]
    assert float(fsdp[pad].abs().max()) == 0.0  # the head is untied here: nothing else trains the pad row
    assert float(fsdp[3:].abs().max()) > 1e-4
    assert float((meg - fsdp).abs().max()) < 1e-5 * max(1.0, float(fsdp.abs().max()))
    assert max_diff(updates["megatron"], updates["fsdp"]) < 1e-5


def test_pad_token_id_is_read_as_nn_embedding_reads_padding_idx():
    from slime.utils.model_shape import ModelShapeError, shape_from_config

    cfg = dict(model_type="llama", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=16)
    assert shape_from_config(cfg).pad_token_id is None
    assert shape_from_config({**cfg, "pad_token_id": 2}).pad_token_id == 2
    assert shape_from_config({**cfg, "pad_token_id": -1}).pad_token_id == 15  # counted from the end
    with pytest.raises(ModelShapeError, match="pad_token_id 16 is outside the vocabulary"):
        shape_from_config({**cfg, "pad_token_id": 16})


def test_fresh_distributed_optimizer_saves_and_resumes(make_trainer, tmp_path):
    """Trap (a): a never-stepped distributed optimizer has no Adam state to save; resuming it is a fresh Adam."""
    groups = make_groups(seed=16)
    a = make_trainer("megatron", "--use-distributed-optimizer", lr=1e-2)
    a.save(str(tmp_path / "fresh"))
    m_a = a.train(0, copy.deepcopy(groups), 0)
    w_a = full_weights(a)
    a.shutdown()
    b = make_trainer("megatron", "--use-distributed-optimizer", lr=1e-2)
    b.load(str(tmp_path / "fresh"))
    m_b = b.train(0, copy.deepcopy(groups), 0)
    assert max_diff(full_weights(b), w_a) == 0.0 and m_a["grad_norm"] == m_b["grad_norm"]


def test_resume_refuses_another_optimizer_kind(make_trainer, tmp_path):
    a = make_trainer("megatron", "--no-use-distributed-optimizer")
    a.save(str(tmp_path / "ckpt"))
    a.shutdown()
    b = make_trainer("megatron")  # the distributed optimizer: Megatron's default, as upstream
    with pytest.raises(ValueError, match="saved with --no-use-distributed-optimizer; resume with "):
        b.load(str(tmp_path / "ckpt"))


def test_tied_embeddings_and_unfused_attention(tmp_path_factory):
    """A tied-embedding checkpoint (Qwen3-0.6B..4B style), megatron's own attention."""
    from slime.backends.megatron_utils.actor import MegatronTrainer

    tied = make_model_dir(tmp_path_factory.mktemp("tied"), seed=2, tie=True)
    t = MegatronTrainer(megatron_args(tied, "--attention-backend", "unfused", "--qk-layernorm"))
    t.init()
    try:
        groups = make_groups(seed=13)
        items = [it for g in flatten_groups(groups)[0] for it in g]
        for s, lp in zip([s for g in groups for s in g], t._log_probs(t.actor, items)):
            assert torch.allclose(lp, reference_log_probs(tied, s), atol=1e-5)
        t.train(0, groups, 0)
        names = set(hf_weights_of(t))
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    finally:
        t.shutdown()


def test_bf16_and_recompute_train(make_trainer, tiny_model_dir):
    groups = make_groups(seed=14)
    ref = make_trainer("megatron", lr=1e-2, micro_batch_size=8)
    m_ref = ref.train(0, copy.deepcopy(groups), 0)
    w_ref = full_weights(ref)
    ref.shutdown()
    for recompute in (["full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], ["selective"]):
        rec = make_trainer("megatron", "--recompute-granularity", *recompute, lr=1e-2, micro_batch_size=8)
        m_rec = rec.train(0, copy.deepcopy(groups), 0)
        assert m_rec["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
        assert max_diff(full_weights(rec), w_ref) <= 1e-6  # recompute changes memory, not numbers
        rec.shutdown()
    bf = make_trainer("megatron", "--bf16", lr=1e-2, micro_batch_size=8)
    assert next(bf.actor.core.parameters()).dtype == torch.bfloat16
    m_bf = bf.train(0, copy.deepcopy(groups), 0)
    assert m_bf["loss"] == pytest.approx(m_ref["loss"], abs=2e-2)  # bf16 tolerance
    assert max_diff(full_weights(bf), w_ref) < 5e-2


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_qwen2_and_llama_match_transformers_and_export_back(family, tmp_path):
    """Qwen2 (q/k/v biases, no q/k norm) and Llama."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.utils.tiny_model import build_tokenizer

    tok = build_tokenizer(list("0123456789+-="))
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    cfg = Qwen2Config(**common) if family == "qwen2" else LlamaConfig(**common, head_dim=8)
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(cfg)
    if family == "qwen2":  # random biases (from_config zeroes them)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.2)
    d = tmp_path / family
    hf.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    t = MegatronTrainer(megatron_args(str(d), *(["--add-qkv-bias"] if family == "qwen2" else [])))
    t.init()
    try:
        groups = make_groups(seed=15)
        items = [it for g in flatten_groups(groups)[0] for it in g]
        for s, lp in zip([s for g in groups for s in g], t._log_probs(t.actor, items)):
            assert torch.allclose(lp, model_log_probs(hf, s), atol=1e-5)
        t.export_hf(str(tmp_path / "out"))
    finally:
        t.shutdown()
    before, after = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert any(k.endswith("q_proj.bias") for k in before) == (family == "qwen2")


def test_tp_shards_reassemble_every_weight_kind():
    """shard / unshard (pure tensors): fused QKV per group, QKV bias, gate/up, row-parallel, vocab."""
    from slime.backends.megatron_utils import hf_weights

    names = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.bias",
             "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight",
             "decoder.layers.0.self_attention.linear_proj.weight", "embedding.word_embeddings.weight",
             "decoder.layers.0.input_layernorm.weight"]
    for name in names:
        full = torch.randn(24, 8) if not name.endswith(("bias", "layernorm.weight")) else torch.randn(24)
        for tp in (1, 2, 4):
            parts = [hf_weights.shard(name, full, r, tp) for r in range(tp)]
            assert torch.equal(hf_weights.unshard(name, parts), full), (name, tp)
    gate, up = torch.randn(8, 4), torch.randn(8, 4)
    local = hf_weights.shard("decoder.layers.0.mlp.linear_fc1.weight", torch.cat([gate, up]), 1, 2)
    assert torch.equal(local, torch.cat([gate[4:], up[4:]]))  # each rank holds its slice of both halves


def test_cpu_shim_leaves_transformers_alone(make_trainer, tmp_path):
    """The shim is process-wide once applied."""
    from transformers import AutoModelForCausalLM

    make_trainer("megatron")
    d = make_model_dir(tmp_path / "after_shim", seed=5)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    head_dim = model.config.head_dim
    theta = model.config.rope_parameters["rope_theta"]
    want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    assert torch.allclose(model.model.rotary_emb.inv_freq, want)
    assert torch.zeros(2).device.type == "cpu" and torch.zeros is torch._C._VariableFunctions.zeros
