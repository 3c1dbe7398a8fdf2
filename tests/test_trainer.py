"""The trainer of either backend (FSDP2; Megatron-core on gloo with the CPU shim) at world size 1, in-process."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_helpers import full_weights
from test_fsdp_helpers import make_args, make_groups, model_log_probs, reference_log_probs
from test_multi_turn import COUNTING, ScriptedModel, fresh_sample, run, runner, script, tok  # noqa: F401

from slime.backends.training_utils.data import flatten_groups
from slime.rollout.multi_turn import ToolAgent
from slime.utils.types import Status

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)
BACKENDS = ["fsdp", "megatron"]


def weights(trainer) -> dict[str, torch.Tensor]:
    if trainer.args.train_backend == "megatron":
        return full_weights(trainer)
    from slime.backends.fsdp_utils.hf_weights import full_state_dict

    return {k: v.clone() for k, v in full_state_dict(trainer.model).items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def log_probs(trainer, groups) -> list[torch.Tensor]:
    return trainer._log_probs(trainer._actor, [it for g in flatten_groups(groups)[0] for it in g])


@pytest.mark.parametrize("backend", BACKENDS)
def test_old_log_probs_match_transformers_and_on_policy_tis_is_identity(make_trainer, tiny_model_dir, backend):
    from slime.backends.training_utils.loss import compute_rollout_tensors

    temperature = 0.7
    t = make_trainer(backend, rollout_temperature=temperature, use_tis=True, micro_batch_size=3)
    groups = make_groups(seed=3)
    for s, lp in zip([s for g in groups for s in g], log_probs(t, groups)):
        want = reference_log_probs(tiny_model_dir, s, temperature)
        assert torch.allclose(lp, want, atol=1e-5), (s.index, (lp - want).abs().max())
        s.rollout_log_probs = want.tolist()  # the engine sampled with exactly these weights
    rt = compute_rollout_tensors(t.args, flatten_groups(groups)[0], log_probs(t, groups), None)
    assert all(torch.allclose(w, torch.ones_like(w), atol=1e-5) for w in rt.tis_weights)
    m = t.train(0, groups, policy_version=0)
    assert m["logprob_abs_diff_max"] < 1e-5
    assert m["tis_ess"] == pytest.approx(1.0, abs=1e-9)
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["tis_clipfrac"] == 0.0
    assert m["ppo_kl"] == pytest.approx(0.0, abs=1e-7)  # first step: ratio is exactly 1
    assert m["pg_clipfrac"] == 0.0


def test_off_policy_tokens_lower_ess(make_trainer):
    t = make_trainer("fsdp", use_tis=True)
    groups = make_groups(seed=4)
    for g in groups:
        for s in g:  # stale behaviour log-probs, different per token
            s.rollout_log_probs = [-0.5 * (i % 3) - 1.0 for i in range(s.response_length)]
    m = t.train(0, groups, 1)
    assert 0.0 < m["tis_ess"] < 0.99
    assert m["logprob_abs_diff_max"] > 0.1


def test_positive_advantage_raises_log_prob(make_trainer, tiny_model_dir):
    t = make_trainer("fsdp", lr=1e-2, n_samples_per_prompt=2, global_batch_size=2)
    groups = make_groups(n_groups=1, group_size=2, seed=5)
    good, bad = groups[0]
    good.reward, bad.reward = 1.0, 0.0
    before = [reference_log_probs(tiny_model_dir, s).sum() for s in (good, bad)]
    t.train(0, groups, 0)
    after = [lp.sum() for lp in log_probs(t, groups)]
    assert after[0] > before[0] + 1e-3
    assert after[1] < before[1] - 1e-3


def _grad_like_update(make_trainer, backend, groups, *argv, **over) -> tuple[dict, dict]:
    # Adam's first step is lr * g / (|g| + eps); with eps = lr >> |g| it is ~g itself.
    t = make_trainer(backend, *argv, lr=1e3, adam_eps=1e3, clip_grad=0.0, **over)
    w0 = weights(t)
    m = t.train(0, copy.deepcopy(groups), 0)
    w1 = weights(t)
    t.shutdown()
    return {k: w0[k] - w1[k] for k in w0}, m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["token_mean", "sample_mean"])
def test_micro_and_dynamic_batches_give_the_same_gradient(make_trainer, agg, backend):
    groups = make_groups(seed=6)
    over = dict(calculate_per_token_loss=agg == "token_mean")
    g_full, m_full = _grad_like_update(make_trainer, backend, groups, micro_batch_size=8, **over)
    g_micro, m_micro = _grad_like_update(make_trainer, backend, groups, micro_batch_size=3, **over)
    g_dyn, m_dyn = _grad_like_update(make_trainer, backend, groups, "--use-dynamic-batch-size",
                                     "--max-tokens-per-gpu", "20", **over)
    scale = max(float(v.abs().max()) for v in g_full.values())
    assert scale > 1e-4  # a real gradient
    assert max_diff(g_full, g_micro) < 1e-5 * max(1.0, scale)
    assert max_diff(g_full, g_dyn) < 1e-5 * max(1.0, scale)
    for m in (m_micro, m_dyn):
        assert m["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
        assert m["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_samples_never_enter_training(make_trainer, backend):
    groups = make_groups(seed=7)
    failed = copy.deepcopy(groups)
    victim = failed[0][1]
    victim.status = Status.FAILED
    victim.reward = None  # a failed reward: would raise if it were used
    victim.metadata["failure"] = "reward timeout"
    without = copy.deepcopy(groups)
    del without[0][1]
    g_failed, m_failed = _grad_like_update(make_trainer, backend, failed, global_batch_size=7)
    g_without, m_without = _grad_like_update(make_trainer, backend, without, global_batch_size=7)
    assert m_failed["num_failed_excluded"] == 1 and m_failed["num_samples"] == 7
    assert max_diff(g_failed, g_without) < 1e-7
    assert m_failed["loss"] == pytest.approx(m_without["loss"], abs=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sft_loss_is_masked_negative_log_likelihood(make_trainer, tiny_model_dir, backend):
    t = make_trainer(backend, loss_type="sft_loss")
    groups = make_groups(seed=9)
    samples = [s for g in groups for s in g]
    samples[0].loss_mask[0] = 0  # masked tokens do not count
    num, den = 0.0, 0.0
    for s in samples:
        lp = reference_log_probs(tiny_model_dir, s)
        mk = torch.tensor(s.loss_mask, dtype=torch.float32)
        num += float((lp * mk).sum())
        den += float(mk.sum())
    assert t.train(0, groups, 0)["sft_loss"] == pytest.approx(-num / den, abs=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_loss_uses_frozen_reference(make_trainer, backend):
    t = make_trainer(backend, use_kl_loss=True, kl_loss_coef=0.1, lr=1e-2)
    assert t._ref is not None
    groups = make_groups(seed=10)
    m0 = t.train(0, copy.deepcopy(groups), 0)
    assert m0["kl_loss"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    m1 = t.train(1, copy.deepcopy(groups), 1)
    assert m1["ref_kl"] != 0.0 and m1["kl_loss"] != 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_load_round_trip_is_exact(make_trainer, tmp_path, backend):
    """The weights, the next step's numbers and the optimizer state or the learning-rate schedule resume exactly."""
    groups = make_groups(seed=11)
    argv = ["--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--lr-decay-iters", "4"] if backend == "megatron" else []
    a = make_trainer(backend, *argv, lr=1e-2)
    a.train(0, copy.deepcopy(groups), 0)
    a.save(str(tmp_path / "ckpt"))
    m_a = a.train(1, copy.deepcopy(groups), 1)
    w_a = weights(a)
    opt_a = copy.deepcopy(a.optimizer.state_dict()) if backend == "fsdp" else None
    a.shutdown()

    b = make_trainer(backend, *argv, lr=1e-2)
    b.load(str(tmp_path / "ckpt"))
    m_b = b.train(1, copy.deepcopy(groups), 1)
    assert max_diff(w_a, weights(b)) == 0.0
    assert m_a["loss"] == m_b["loss"] and m_a["grad_norm"] == m_b["grad_norm"]
    if backend == "megatron":
        assert m_a["lr"] == m_b["lr"] and 0 < m_a["lr"] < 1e-2  # the schedule resumed mid-decay
        return
    opt_b = b.optimizer.state_dict()
    for k, st in opt_a["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            x, y = st[name], opt_b["state"][k][name]
            x = x.full_tensor() if hasattr(x, "full_tensor") else x
            y = y.full_tensor() if hasattr(y, "full_tensor") else y
            assert torch.equal(x, y), (k, name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_export_hf_loads_with_from_pretrained(make_trainer, tmp_path, backend):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = make_trainer(backend, lr=1e-2)
    groups = make_groups(seed=12)
    t.train(0, groups, 0)
    out = tmp_path / "hf"
    t.export_hf(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok.encode("1+2=", add_special_tokens=False)) == "1+2="
    assert torch.allclose(model_log_probs(model, groups[0][0]), log_probs(t, groups)[0], atol=1e-5)


# ------------------------------------------------- the trainer's policy loss ----
def _loss_inputs(advantages, log_probs, tis=None):
    from slime.backends.training_utils.loss import RolloutTensors

    lps = [torch.tensor(lp, requires_grad=True) for lp in log_probs]
    masks = [torch.ones(len(lp)) for lp in log_probs]
    rt = RolloutTensors(old_log_probs=[torch.zeros(len(lp)) for lp in log_probs], ref_log_probs=None,
                        advantages=[a * torch.ones(len(lp)) for a, lp in zip(advantages, log_probs)],
                        tis_weights=None if tis is None else [torch.tensor(w) for w in tis], metrics={})
    return lps, masks, rt


def test_gspo_dual_clip_applies_through_the_trainer_loss(tmp_path):
    """--advantage-estimator gspo --eps-clip-c 3."""
    import math

    from slime.backends.training_utils.loss import loss_inputs, micro_batch_loss

    # sequence ratios: e^1.5 ~ 4.48 with A=-1 (dual-clipped), e^0.5 with A=-2 (not), e^1.5 with A=+1 (PPO clip)
    log_probs, advantages = [[1.0, 2.0], [0.5, 0.5], [1.5, 1.5]], [-1.0, -2.0, 1.0]
    results = {}
    for eps_c in (None, 3.0):
        args = make_args(str(tmp_path), "--train-backend", "fsdp", advantage_estimator="gspo", eps_clip_c=eps_c, calculate_per_token_loss=False)
        lps, masks, rt = _loss_inputs(advantages, log_probs)
        inp = loss_inputs(args, rt, [0, 1, 2], masks, num_tokens=6.0, num_samples=3.0, device="cpu")
        loss, metrics = micro_batch_loss(args, torch.cat(lps), None, inp)
        loss.backward()
        results[eps_c] = (loss.item(), {k: float(v) for k, v in metrics.items()}, [lp.grad.clone() for lp in lps])
    first = 3.0  # capped at -A * eps_clip_c
    rest = 2 * math.exp(0.5) - 1.2
    assert results[3.0][0] == pytest.approx((first + rest) / 3, rel=1e-6)
    assert results[None][0] == pytest.approx((math.exp(1.5) + rest) / 3, rel=1e-6)
    assert torch.equal(results[3.0][2][0], torch.zeros(2))  # no gradient through the cap
    assert results[None][2][0].abs().min() > 0
    torch.testing.assert_close(results[3.0][2][1], results[None][2][1])
    m = results[3.0][1]
    assert m["pg_dual_clipfrac"] == pytest.approx(1 / 3) and m["pg_clipfrac"] == pytest.approx(1 / 3)
    assert "pg_dual_clipfrac" not in results[None][1]


def test_gspo_tis_weights_each_tokens_gradient_by_its_own_weight(tmp_path):
    """Convention: under GSPO the TIS weight of token t scales token t's gradient (upstream spreads mean(w))."""
    from slime.backends.training_utils.loss import loss_inputs, micro_batch_loss

    args = make_args(str(tmp_path), "--train-backend", "fsdp", advantage_estimator="gspo", use_tis=True, calculate_per_token_loss=False)
    lps, masks, rt = _loss_inputs([1.0], [[0.0, 0.0, 0.0]], tis=[[0.5, 2.0, 1.0]])
    inp = loss_inputs(args, rt, [0], masks, num_tokens=3.0, num_samples=1.0, device="cpu")
    loss, _ = micro_batch_loss(args, torch.cat(lps), None, inp)
    loss.backward()
    # loss = mean_t(-A * s * w_t) with s = 1: d/d logp_t = -w_t / 3 (upstream: -mean(w) / 3 for every token)
    torch.testing.assert_close(lps[0].grad, torch.tensor([-0.5, -2.0, -1.0]) / 3)


def test_gspo_with_dual_clip_trains_with_gradient_accumulation(make_trainer):
    """Two optimizer steps per rollout (8 samples, --global-batch-size 4) under GSPO with the dual clip."""
    t = make_trainer("fsdp", advantage_estimator="gspo", eps_clip_c=3.0, global_batch_size=4)
    m = t.train(0, make_groups(seed=13), 0)
    assert m["pg_dual_clipfrac"] == 0.0  # the first step is on-policy (ratio 1)
    assert m["num_optimizer_steps"] == 2 and m["num_samples"] == 8
    assert torch.isfinite(torch.tensor(m["loss"]))


def test_observation_tokens_never_carry_gradient(tok, script, runner, base_args, tmp_path):
    """The trainer's own loss (policy gradient with TIS, entropy bonus) on multi-turn samples."""
    import torch

    from slime.backends.fsdp_utils.model import forward_micro_batch, load_hf_model
    from slime.backends.training_utils.data import build_micro_batch, flatten_groups
    from slime.backends.training_utils.loss import compute_rollout_tensors, loss_inputs, micro_batch_loss
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3

    torch.manual_seed(0)
    build_tiny_qwen3(str(tmp_path / "m"), tok, TinyQwen3Spec(hidden_size=32, num_hidden_layers=1,
                                                             num_attention_heads=2, num_key_value_heads=1,
                                                             intermediate_size=64), seed=0)
    model = load_hf_model(str(tmp_path / "m"))  # as the trainer loads it: the head feeds the chunked log-prob head
    target, obs = script
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    group = [run(agent, fresh_sample(tok, i), ScriptedModel(tok, 6, target, obs), budget=b)
             for i, b in enumerate((256, 20))]  # complete and cut: different rewards, nonzero advantages
    for s, r in zip(group, (1.0, 0.0)):
        s.reward, s.group_index = r, 0
    args = base_args.replace(use_tis=True, entropy_coef=0.01, advantage_estimator="grpo")
    item_groups, _ = flatten_groups([group])
    items = [it for g in item_groups for it in g]
    mb = build_micro_batch(items, tok.pad_token_id, packed=False)
    with torch.no_grad():
        old = list(forward_micro_batch(model, mb, 1.0, 64)[0].split([it.response_len for it in mb.items]))
    rt = compute_rollout_tensors(args, item_groups, old, None)
    lps, ents, _ = forward_micro_batch(model, mb, 1.0, 64, with_entropy=True, entropy_grad=True)
    lps.retain_grad()
    ents.retain_grad()
    masks = [it.loss_mask for it in items]
    inp = loss_inputs(args, rt, list(range(len(items))), masks, float(sum(m.sum() for m in masks)),
                      float(len(items)), "cpu")
    loss, _ = micro_batch_loss(args, lps, ents, inp)
    loss.backward()
    mask = torch.cat(masks)
    assert (mask == 0).any() and (mask == 1).any()
    assert torch.all(lps.grad[mask == 0] == 0) and torch.all(ents.grad[mask == 0] == 0)
    assert torch.all(lps.grad[mask == 1] != 0)
    assert sum(s.response_length for s in group) == mask.numel()


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone()
            for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tis", [False, True])
def test_one_step_rollout_takes_old_log_probs_from_its_own_forward(make_trainer, tis):
    """One optimizer step per rollout."""
    t = make_trainer("fsdp", "--use-tis" if tis else "--no-use-wandb", micro_batch_size=3)
    groups = make_groups(seed=11)
    for s in groups[0][1:3]:  # resumed samples: their first tokens sampled by an older policy
        s.rollout_log_probs = [-0.3 * (i % 4) - 0.5 for i in range(s.response_length)]
    out = {}
    for old_forward in (True, False):
        calls = []
        real = t._log_probs
        t._log_probs = lambda model, items: calls.append(1) or real(model, items)
        try:
            items, rt, _ = t._prepare(copy.deepcopy(groups), old_forward=None if not old_forward else True)
        finally:
            del t._log_probs
        assert len(calls) == (1 if old_forward else 0)
        assert (rt.old_log_probs is None) == (not old_forward)
        seen = ([], []) if rt.old_log_probs is None else None
        parts = t._accumulate_grads(items, rt, seen)
        metrics = {k: float(v) for k, v in parts.items()}
        if seen is not None:
            from slime.backends.training_utils.loss import behaviour_metrics

            metrics.update(behaviour_metrics(t.args, items, t._gather_log_probs(*seen, len(items)), None)[0])
        else:
            metrics.update(rt.metrics)
        out[old_forward] = (_grads(t), metrics)
    (g_with, m_with), (g_without, m_without) = out[True], out[False]
    assert max_diff(g_with, g_without) < 1e-6 * max(1.0, max(float(v.abs().max()) for v in g_with.values()))
    for k in ("loss", "pg_loss", "ppo_kl", "tis_ess", "tis_weight_mean", "tis_clipfrac", "logprob_abs_diff_max"):
        assert m_without[k] == pytest.approx(m_with[k], abs=1e-6), k
    assert m_with["logprob_abs_diff_max"] > 0.1  # the resumed tokens' behaviour log-probs differ
    if tis:
        assert m_with["tis_ess"] < 0.99


def test_old_log_probs_get_their_own_forward_only_when_needed(make_trainer):
    """More than one optimizer step per rollout (later steps see updated weights), or --kl-coef."""
    for over, forwards in ((dict(global_batch_size=8), 0), (dict(global_batch_size=4), 1),
                           (dict(global_batch_size=8, kl_coef=0.1), 1)):
        t = make_trainer("fsdp", **over)
        calls = []
        real = t._log_probs
        t._log_probs = lambda model, items: calls.append(model is t._actor) or real(model, items)
        m = t.train(0, make_groups(seed=12), 0)
        assert sum(calls) == forwards, over
        assert {"logprob_abs_diff_max", "tis_ess"} <= m.keys()
        t.shutdown()
