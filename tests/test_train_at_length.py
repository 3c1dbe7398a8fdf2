"""Training at length, on both backends (world size 1, in-process)."""

from __future__ import annotations

import copy
import gc
import json
import os
import weakref

import pytest
import torch

from megatron_helpers import full_grads, megatron_args
from test_fsdp_helpers import WORDS, make_groups

from slime.backends.training_utils.data import TrainItem, flatten_groups, plan_micro_batches

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)


@pytest.fixture
def trainer(make_trainer):
    """`trainer(backend, model_dir, *argv, **over)`: conftest's make_trainer on `model_dir`."""
    return lambda backend, model_dir, *argv, **over: make_trainer(backend, *argv, model_dir=model_dir, **over)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def grads_of(t) -> dict[str, torch.Tensor]:
    if hasattr(t, "layout"):
        return full_grads(t)
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in t.model.named_parameters()}


def step(t, groups):
    """Old log-probs and the gradients of one optimizer step (no update)."""
    items, rt, _ = t._prepare(copy.deepcopy(groups))
    parts = t._accumulate_grads(items, rt)
    return rt.old_log_probs, parts["loss"], grads_of(t)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_packed_micro_batches_equal_padded(trainer, model_dir, backend):
    groups = make_groups(seed=41)
    t = trainer(backend, model_dir, micro_batch_size=3, entropy_coef=0.01)
    assert t.args.micro_batch_layout == "packed"
    lps_packed, loss_packed, g_packed = step(t, groups)
    t.args = t.args.replace(micro_batch_layout="padded")
    lps_padded, loss_padded, g_padded = step(t, groups)
    assert max(float((a - b).abs().max()) for a, b in zip(lps_packed, lps_padded)) <= 1e-5
    assert abs(loss_packed - loss_padded) <= 1e-6
    assert max(float(g.abs().max()) for g in g_packed.values()) > 1e-3  # a real gradient
    assert max_diff(g_packed, g_padded) <= 1e-5


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_samples_longer_than_the_token_budget_train_alone(trainer, model_dir, backend):
    groups = make_groups(seed=42)
    longest = max(len(s.tokens) for g in groups for s in g)
    fixed = trainer(backend, model_dir, micro_batch_size=8)
    _, loss_fixed, g_fixed = step(fixed, groups)
    budget = trainer(backend, model_dir, "--use-dynamic-batch-size", "--max-tokens-per-gpu", str(longest - 3))
    items = [it for g in flatten_groups(groups)[0] for it in g]
    bins = budget._plan(items)
    assert any(len(b) == 1 and b[0].num_tokens > longest - 3 for b in bins)
    _, loss_budget, g_budget = step(budget, groups)
    assert abs(loss_fixed - loss_budget) <= 1e-6 and max_diff(g_fixed, g_budget) <= 1e-5
    m = budget.train(0, copy.deepcopy(groups), 0)
    assert m["grad_norm"] > 0 and m["num_samples"] == len(items)


def _item(pos: int, n: int) -> TrainItem:
    return TrainItem(pos=pos, tokens=torch.zeros(n, dtype=torch.long), prompt_len=1, loss_mask=torch.ones(n - 1),
                     rollout_log_probs=torch.zeros(n - 1), reward=0.0)


def test_token_budget_bins_are_balanced_across_ranks():
    lengths = [900, 40, 500, 480, 60, 300, 310, 20, 1500, 250, 260, 700, 90, 100, 30, 330]
    items = [_item(i, n) for i, n in enumerate(lengths)]
    plan = plan_micro_batches(items, dp_size=2, micro_batch_size=1, max_tokens=1000)
    assert sorted(it.pos for rank in plan for b in rank for it in b) == list(range(len(items)))
    assert len(plan[0]) == len(plan[1])  # every rank the same number of micro-batches
    loads = [sum(it.num_tokens for b in rank for it in b) for rank in plan]
    assert abs(loads[0] - loads[1]) <= max(lengths) // 2, loads
    for rank in plan:
        for b in rank:
            assert len(b) == 1 or sum(it.num_tokens for it in b) <= 1000
    assert any(len(b) == 1 and b[0].num_tokens == 1500 for rank in plan for b in rank)  # over budget: alone
    fixed = plan_micro_batches(items, dp_size=2, micro_batch_size=3)
    assert [[it.pos for it in b] for b in fixed[1]] == [[1, 3, 5], [7, 9, 11], [13, 15]]


def test_both_backends_report_the_same_metric_keys(trainer, model_dir):
    over = dict(eps_clip_c=3.0, use_kl_loss=True, kl_loss_coef=0.1)
    keys = {}
    for backend in ("fsdp", "megatron"):
        keys[backend] = set(trainer(backend, model_dir, **over).train(0, make_groups(seed=43), 0))
    assert keys["fsdp"] == keys["megatron"]
    assert {"pg_dual_clipfrac", "kl_loss", "entropy", "grad_norm", "train_time_s", "num_tokens"} <= keys["fsdp"]


@pytest.fixture(scope="module")
def big_vocab_dir(tmp_path_factory):
    """A tiny Qwen3 with Qwen's 151,936-token vocabulary (the vocabulary is what makes logits big)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from slime.utils.tiny_model import build_tokenizer

    d = tmp_path_factory.mktemp("vocab152k")
    tok = build_tokenizer(WORDS)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=2048,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    with open(os.path.join(d, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    return str(d)


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_one_train_with_a_151936_token_vocabulary_stays_within_its_memory_bound(trainer, big_vocab_dir, backend):
    """2 samples of 256 tokens in one micro-batch."""
    from slime.utils.peak_memory import PeakRSS

    from slime.utils.types import Sample, Status

    def group(response_len: int) -> list[list[Sample]]:
        out = []
        for i in range(2):
            s = Sample(index=i, group_index=0, tokens=[1, 5, 6, 7])
            s.append_response([3 + (j * 7 + i) % 5000 for j in range(response_len)], [-1.0] * response_len, 0)
            s.reward, s.status = float(i), Status.COMPLETED
            out.append(s)
        return [out]
    t = trainer(backend, big_vocab_dir, micro_batch_size=2, n_samples_per_prompt=2, rollout_batch_size=1,
                global_batch_size=2)
    t.train(0, group(4), 0)  # warm-up (short samples): the optimizer state exists
    with PeakRSS() as rss:
        m = t.train(1, group(252), 1)
    assert m["num_tokens"] == 2 * 256
    print(f"{backend}: peak RSS +{rss.rise / 2**30:.3f} GB ({'exact' if rss.exact else 'sampled'})")
    assert rss.rise <= 0.4 * 2**30, f"peak RSS rose {rss.rise / 2**30:.2f} GB"


def test_fsdp_bf16_computes_in_bf16_over_fp32_master_weights(trainer, model_dir):
    groups = make_groups(seed=45)
    items = [it for g in flatten_groups(groups)[0] for it in g]
    fp32 = trainer("fsdp", model_dir)
    bf16 = trainer("fsdp", model_dir, "--bf16")
    lp32, lp16 = fp32._log_probs(fp32.model, items), bf16._log_probs(bf16.model, items)
    diff = max(float((a - b).abs().max()) for a, b in zip(lp32, lp16))
    assert 1e-6 < diff < 0.1  # bf16 rounding, not another model
    m = bf16.train(0, copy.deepcopy(groups), 0)
    assert m["grad_norm"] > 0
    params = list(bf16.model.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert all(v.dtype == torch.float32 for s in bf16.optimizer.state.values() for v in s.values() if v.dim())
    from slime.backends.fsdp_utils.model import final_hidden
    from slime.backends.training_utils.data import build_micro_batch
    from slime.backends.training_utils.distributed import device

    with torch.no_grad():
        mb = build_micro_batch(items[:2], bf16.pad_id, True, device())
        assert final_hidden(bf16.model, mb).dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_shutdown_lets_go_of_the_model_and_optimizer(trainer, model_dir, backend):
    gc.collect()
    cuda = torch.cuda.is_available()
    baseline = torch.cuda.memory_allocated() if cuda else 0
    t = trainer(backend, model_dir)
    t.train(0, make_groups(seed=46), 0)
    held = torch.cuda.memory_allocated() - baseline if cuda else 0
    params = list(t.model.parameters()) if backend == "fsdp" else list(t.actor.core.parameters())
    refs = [weakref.ref(p) for p in params]
    del params
    t.shutdown()
    t.shutdown()  # idempotent
    gc.collect()
    assert all(r() is None for r in refs)
    if cuda:  # what may stay is not the trainer's: cuBLAS workspaces (tens of MB on Hopper) and the like
        assert torch.cuda.memory_allocated() - baseline <= max(0.1 * held, 64 * 2**20), (held, baseline)


@pytest.mark.slow  # inductor compiles C++ kernels on a CPU: tens of seconds on a fresh machine
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_compiled_ops_give_the_same_gradients(trainer, model_dir, backend):
    groups = make_groups(seed=47)
    plain = trainer(backend, model_dir)
    lps0, loss0, g0 = step(plain, groups)
    plain.shutdown()
    lps1, loss1, g1 = step(trainer(backend, model_dir, "--compile-ops"), groups)
    assert max(float((a - b).abs().max()) for a, b in zip(lps0, lps1)) <= 1e-5
    assert abs(loss0 - loss1) <= 1e-6 and max_diff(g0, g1) <= 1e-5


def test_layer_spec_choice_and_transformer_engine_names(model_dir):
    from slime.backends.megatron_utils.layer_spec import canonical_name, layer_impl, transformer_engine_available

    args = megatron_args(model_dir)
    assert layer_impl(args) == ("transformer_engine" if transformer_engine_available() else "local")
    assert layer_impl(args.replace(transformer_impl="local")) == "local"
    if not transformer_engine_available():
        with pytest.raises(RuntimeError, match="--transformer-impl transformer_engine"):
            layer_impl(args.replace(transformer_impl="transformer_engine"))
    # TE folds the pre-norms into the next linear layer; the HF mapping speaks the local spec's names
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("decoder.layers.0.self_attention.q_layernorm.weight") == \
        "decoder.layers.0.self_attention.q_layernorm.weight"


def test_compile_ops_is_on_where_the_trainer_runs_on_a_gpu(parse_with):
    """--compile-ops auto (the default) fuses on a GPU and not on CPU; the bare flag means on; off is off."""
    from slime.backends.training_utils.distributed import compile_ops

    assert parse_with().compile_ops == "auto"
    assert compile_ops(parse_with()) == torch.cuda.is_available()
    assert compile_ops(parse_with(compile_ops=True)) and compile_ops(parse_with(compile_ops="on"))
    assert not compile_ops(parse_with(compile_ops="off"))
    with pytest.raises(SystemExit):
        parse_with(compile_ops="sometimes")
