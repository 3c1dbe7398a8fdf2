"""RL losses, KL, entropy, aggregation and TIS checked against hand values and independent python/numpy computations."""

import math

import numpy as np
import pytest
import torch

from slime.utils.ppo_utils import (
    aggregate_loss,
    compute_approx_kl,
    compute_entropy_from_logits,
    compute_ess,
    clipped_surrogate,
    compute_gspo_ratio,
    compute_log_probs,
    compute_tis_weights,
    dual_clip_flags,
    masked_mean,
    MAX_LOG_RATIO,
    policy_ratio,
    loss_agg_mode,
    sft_loss,
)

torch.set_num_threads(1)


def compute_policy_loss(logp, old, adv, *clip):
    """The token-level PPO loss as the trainer computes it (training_utils/loss.py's micro_batch_loss)."""
    return clipped_surrogate(policy_ratio(logp, old), adv, *clip)


def compute_gspo_policy_loss(logp, old, adv, mask, *clip, eps_clip_c=None):
    """GSPO's loss as the trainer computes it: the clipped surrogate on the sequence ratio."""
    return clipped_surrogate(compute_gspo_ratio(logp, old, mask), adv, *clip, eps_clip_c=eps_clip_c)


# ------------------------------------------------------------ log-probs ----
def test_log_probs_match_python_softmax_with_temperature():
    logits = torch.tensor([[[2.0, 0.5, -1.0, 3.0], [0.0, 0.0, 1.0, -2.0]]])
    tokens = torch.tensor([[3, 2]])
    temp = 0.7
    got = compute_log_probs(logits, tokens, temp)
    for t in range(2):
        row = [x / temp for x in logits[0, t].tolist()]
        z = math.log(sum(math.exp(x) for x in row))
        assert got[0, t].item() == pytest.approx(row[tokens[0, t]] - z, abs=1e-6)


def test_log_probs_stable_for_huge_logits_and_differentiable():
    logits = torch.tensor([[1000.0, 0.0, -1000.0]], requires_grad=True)
    lp = compute_log_probs(logits, torch.tensor([1]), 1.0)
    assert lp.item() == pytest.approx(-1000.0, abs=1e-3)
    lp.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # d logp_k / d logits = onehot(k) - softmax
    np.testing.assert_allclose(logits.grad.numpy(), [[-1.0, 1.0, 0.0]], atol=1e-6)
    # temperature 0 (greedy) reports the unscaled distribution, as SGLang does
    torch.testing.assert_close(compute_log_probs(logits, torch.tensor([1]), 0.0), lp.detach())
    with pytest.raises(ValueError, match="temperature"):
        compute_log_probs(logits, torch.tensor([1]), -1.0)


# -------------------------------------------------------------- entropy ----
def test_entropy_uniform_is_log_vocab_and_matches_reference():
    for v in (2, 7, 50):
        ent = compute_entropy_from_logits(torch.full((3, v), 4.2))
        np.testing.assert_allclose(ent.numpy(), math.log(v), rtol=1e-6)
    logits = torch.tensor([1.0, 2.0, 0.5, -3.0])
    p = np.exp(logits.numpy() / 2.0)
    p /= p.sum()
    assert compute_entropy_from_logits(logits, 2.0).item() == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-6)


def test_entropy_stable_with_extreme_and_banned_logits():
    logits = torch.tensor([[5000.0, 0.0, float("-inf")], [0.0, 0.0, float("-inf")]], requires_grad=True)
    ent = compute_entropy_from_logits(logits)
    assert ent[0].item() == pytest.approx(0.0, abs=1e-6)
    assert ent[1].item() == pytest.approx(math.log(2), abs=1e-6)
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ------------------------------------------------------------------- KL ----
def test_kl_estimators_known_values_and_zero_at_equal_inputs():
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.1])
    assert all(torch.equal(compute_approx_kl(lp, lp, t), torch.zeros(4)) for t in ("k1", "k2", "k3", "low_var_kl"))
    ref = torch.tensor([-1.5, -0.5, -1.0, -30.0])
    for i in range(4):
        d = lp[i].item() - ref[i].item()
        assert compute_approx_kl(lp, ref, "k1")[i].item() == pytest.approx(d, abs=1e-6)
        assert compute_approx_kl(lp, ref, "k2")[i].item() == pytest.approx(0.5 * d * d, rel=1e-6)
        k3 = math.exp(-d) - (-d) - 1
        assert compute_approx_kl(lp, ref, "k3")[i].item() == pytest.approx(k3, rel=1e-5)
        assert compute_approx_kl(lp, ref, "low_var_kl")[i].item() == pytest.approx(max(-10, min(10, k3)), rel=1e-5)
    # k3 is non-negative; large ref >> logp is where low_var_kl clamps at 10
    big = compute_approx_kl(torch.tensor([-20.0]), torch.tensor([-1.0]), "k3").item()
    assert big == pytest.approx(math.exp(19) - 19 - 1, rel=1e-5)
    assert compute_approx_kl(torch.tensor([-20.0]), torch.tensor([-1.0]), "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="kl-loss-type"):
        compute_approx_kl(lp, ref, "k4")


# --------------------------------------------------------- PPO loss ----
def _ref_ppo(logp, old, adv, eps, eps_high, eps_c=None):
    """(loss, PPO-clip flag, dual-clip flag) for one token, in python floats."""
    r = math.exp(logp - old)
    l1 = -adv * r
    l2 = -adv * min(max(r, 1 - eps), 1 + eps_high)
    loss = max(l1, l2)
    clipped, dual = l2 > l1, False
    if eps_c is not None and adv < 0 and loss > -adv * eps_c:
        loss, dual = -adv * eps_c, True
    return loss, float(clipped), float(dual)


def test_policy_loss_matches_reference_with_asymmetric_and_dual_clip():
    old = torch.zeros(6)
    logp = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9, 5.0, 2.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0, -1.0, 0.5])
    for eps_c in (None, 3.0):
        loss, clip = compute_policy_loss(logp, old, adv, 0.2, 0.28, eps_c)
        dual = dual_clip_flags(policy_ratio(logp, old), adv, eps_c) if eps_c else torch.zeros(6)
        for i in range(6):
            rl, rc, rd = _ref_ppo(logp[i].item(), 0.0, adv[i].item(), 0.2, 0.28, eps_c)
            assert loss[i].item() == pytest.approx(rl, rel=1e-6), (i, eps_c)
            assert clip[i].item() == rc, (i, eps_c)
            assert dual[i].item() == rd, (i, eps_c)
    # by hand: ratio 1.5 > 1.28 with A=1 -> -1.28 (clipped high side)
    loss, clip = compute_policy_loss(logp, old, adv, 0.2, 0.28, 3.0)
    assert loss[0].item() == pytest.approx(-1.28) and clip[0] == 1.0
    # ratio 0.5 < 0.8 with A=-1 -> 0.8 (clipped low side)
    assert loss[2].item() == pytest.approx(0.8) and clip[2] == 1.0
    # ratio 5 with A=-1: unclipped 5, dual-clip bound 3; pg_clipfrac does not count it (as upstream),
    # pg_dual_clipfrac does
    assert loss[4].item() == pytest.approx(3.0) and clip[4] == 0.0
    assert dual_clip_flags(policy_ratio(logp, old), adv, 3.0).tolist() == [0, 0, 0, 0, 1, 0]
    # within the trust region: no clip
    assert loss[1].item() == pytest.approx(-1.1) and clip[1] == 0.0


def test_log_ratio_clamp_keeps_the_gradient_straight_through():
    """|log-ratio| > MAX_LOG_RATIO: the value is capped at e^±20, the gradient is not silently zeroed."""
    old = torch.zeros(4)
    logp = torch.tensor([25.0, 1000.0, -25.0, 0.1], requires_grad=True)
    adv = torch.tensor([-1.0, -1.0, 1.0, -2.0])
    ratio = policy_ratio(logp, old)
    np.testing.assert_allclose(ratio.detach().numpy(), [math.exp(20), math.exp(20), math.exp(-20), math.exp(0.1)],
                               rtol=1e-6)
    loss, clip = compute_policy_loss(logp, old, adv, 0.2)  # no dual clip: A < 0 tokens are unclipped
    assert torch.isfinite(loss).all()
    loss.sum().backward()
    # d(-A r)/d logp = -A r, with r the capped ratio: e^20 and e^-20 instead of a plain clamp's 0
    np.testing.assert_allclose(logp.grad.numpy(), [math.exp(20), math.exp(20), -math.exp(-20), 2 * math.exp(0.1)],
                               rtol=1e-5)
    assert MAX_LOG_RATIO == 20.0
    # with the dual clip the capped tokens' gradient is removed by the clip (a visible decision), not the clamp
    logp.grad = None
    loss, _ = compute_policy_loss(logp, old, adv, 0.2, 0.2, 3.0)
    loss.sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), [0.0, 0.0, -math.exp(-20), 2 * math.exp(0.1)], rtol=1e-5)
    # no gradient needed: the plain clamp
    assert policy_ratio(torch.tensor([30.0]), torch.zeros(1)).item() == pytest.approx(math.exp(20), rel=1e-6)
    # an infinite log-ratio stays finite and NaN-free (no gradient there)
    inf = torch.tensor([float("inf"), 0.0], requires_grad=True)
    r = policy_ratio(inf, torch.zeros(2))
    r.sum().backward()
    assert torch.isfinite(r).all() and torch.isfinite(inf.grad).all() and inf.grad[0] == 0.0


def test_policy_loss_gradients_zero_when_clipped_and_ratio_times_adv_otherwise():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.1, 0.5, 5.0])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, _ = compute_policy_loss(logp, old, adv, 0.2, 0.28, 3.0)
    loss.sum().backward()
    # d(-A r)/d logp = -A r inside the region; 0 where clipped (incl. dual clip)
    np.testing.assert_allclose(logp.grad.numpy(), [0.0, -1.1, 0.0, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="eps-clip-c"):
        compute_policy_loss(logp, old, adv, 0.2, 0.28, 1.0)


# --------------------------------------------------------------- GSPO ----
def test_gspo_ratio_is_geometric_mean_of_token_ratios():
    logp = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.3, -0.2, -0.1, -0.4]])
    old = torch.tensor([[-1.2, -0.4, -2.5, 0.0], [-0.3, -0.2, -0.1, -0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ratio = compute_gspo_ratio(logp, old, mask)
    for b in range(2):
        toks = [math.exp(logp[b, t].item() - old[b, t].item()) for t in range(4) if mask[b, t]]
        geo = math.prod(toks) ** (1 / len(toks))
        np.testing.assert_allclose(ratio[b].numpy(), geo, rtol=1e-6)
    assert torch.allclose(ratio[1], torch.ones(4))
    # list form (packed samples of unequal lengths) gives the same values
    lst = compute_gspo_ratio([logp[0, :3], logp[1]], [old[0, :3], old[1]], [mask[0, :3], mask[1]])
    torch.testing.assert_close(lst[0], ratio[0, :3])
    # empty mask -> ratio 1
    assert compute_gspo_ratio(logp[0], old[0], torch.zeros(4)).tolist() == [1.0] * 4


def test_gspo_sg_trick_gradient_is_sequence_ratio_per_token():
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old = torch.tensor([-1.1, -0.45, -2.2])
    mask = torch.ones(3)
    ratio = compute_gspo_ratio(logp, old, mask)
    s = math.exp(sum(logp[t].item() - old[t].item() for t in range(3)) / 3)
    weights = torch.tensor([1.0, 2.0, -3.0])
    (ratio * weights).sum().backward()
    np.testing.assert_allclose(logp.grad.numpy(), s * weights.numpy(), rtol=1e-6)


def test_gspo_policy_loss_clips_on_the_sequence_ratio():
    old = torch.zeros(2, 3)
    # seq 0: log-ratio mean 0.001 -> s ~ 1.001 > 1 + 4e-4; seq 1: tiny deviations -> unclipped
    logp = torch.tensor([[0.003, 0.0, 0.0], [1e-4, -1e-4, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.ones(2, 3)
    loss, clip = compute_gspo_policy_loss(logp, old, adv, mask, 3e-4, 4e-4)
    assert torch.equal(clip[0], torch.ones(3)) and torch.equal(clip[1], torch.zeros(3))
    np.testing.assert_allclose(loss[0].detach().numpy(), -(1 + 4e-4), rtol=1e-6)
    np.testing.assert_allclose(loss[1].detach().numpy(), 1.0, rtol=1e-6)
    aggregate_loss(loss, mask, "sample_mean").backward()
    # clipped sequence gets no gradient; unclipped: d/dlogp_t of mean_t(A * s) / 2 samples
    assert torch.equal(logp.grad[0], torch.zeros(3))
    np.testing.assert_allclose(logp.grad[1].numpy(), [1.0 / 3 / 2] * 3, rtol=1e-5)


def test_gspo_dual_clip_caps_negative_advantage_sequences():
    old = torch.zeros(3, 2)
    # sequence ratios e^1.5 ~ 4.48 (A < 0: dual-clipped at 3), e^1.5 (A > 0: PPO-clipped), e^0.5 ~ 1.65 (A < 0, under 3)
    logp = torch.tensor([[1.0, 2.0], [1.5, 1.5], [0.5, 0.5]], requires_grad=True)
    adv = torch.tensor([[-1.0] * 2, [1.0] * 2, [-2.0] * 2])
    mask = torch.ones(3, 2)
    loss, clip = compute_gspo_policy_loss(logp, old, adv, mask, 0.2, 0.28, eps_clip_c=3.0)
    np.testing.assert_allclose(loss.detach().numpy(), [[3.0] * 2, [-1.28] * 2, [2 * math.exp(0.5)] * 2], rtol=1e-6)
    assert clip.tolist() == [[0.0] * 2, [1.0] * 2, [0.0] * 2]
    loss.sum().backward()
    assert torch.equal(logp.grad[:2], torch.zeros(2, 2))  # capped and clipped sequences: no gradient
    np.testing.assert_allclose(logp.grad[2].numpy(), [2 * math.exp(0.5)] * 2, rtol=1e-6)
    unclipped, _ = compute_gspo_policy_loss(logp.detach(), old, adv, mask, 0.2, 0.28)
    assert unclipped[0, 0].item() == pytest.approx(math.exp(1.5), rel=1e-6)  # without --eps-clip-c: not capped
    with pytest.raises(ValueError, match="eps-clip-c"):
        compute_gspo_policy_loss(logp, old, adv, mask, 0.2, 0.28, eps_clip_c=0.5)


# --------------------------------------------------------- aggregation ----
def test_aggregate_token_and_sample_mean_by_hand():
    losses = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, float("nan")])]
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 0])]
    # token mean: (1 + 2 + 10) / 3; sample mean: (1.5 + 10) / 2
    assert aggregate_loss(losses, masks, "token_mean").item() == pytest.approx(13 / 3)
    assert aggregate_loss(losses, masks, "sample_mean").item() == pytest.approx(5.75)
    padded = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 0.0]])
    pmask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_loss(padded, pmask, "token_mean").item() == pytest.approx(13 / 3)
    assert aggregate_loss(padded, pmask, "sample_mean").item() == pytest.approx(5.75)
    # global denominators for micro-batching
    assert aggregate_loss(losses, masks, "token_mean", num_tokens=6).item() == pytest.approx(13 / 6)
    assert aggregate_loss(losses, masks, "sample_mean", num_samples=4).item() == pytest.approx(11.5 / 4)
    with pytest.raises(ValueError, match="loss-agg-mode"):
        aggregate_loss(losses, masks, "seq_sum")


def test_empty_masks_give_zero_and_keep_graph():
    x = torch.tensor([[1.0, float("inf")], [2.0, 3.0]], requires_grad=True)
    zeros = torch.zeros(2, 2)
    for mode in ("token_mean", "sample_mean"):
        out = aggregate_loss(x, zeros, mode)
        assert out.item() == 0.0 and out.requires_grad
        out.backward()
        assert torch.equal(x.grad, torch.zeros(2, 2))
        x.grad = None
    mm = masked_mean(x, zeros)
    assert mm.item() == 0.0 and mm.requires_grad
    # one empty sample in a sample_mean batch counts as 0
    got = aggregate_loss([x[0], x[1]], [torch.zeros(2), torch.ones(2)], "sample_mean")
    assert got.item() == pytest.approx(1.25)
    got.backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 0], [0.25, 0.25]])


def test_token_mean_with_a_fully_masked_sample_divides_by_real_tokens():
    """Convention: an empty sample adds no phantom token to the --calculate-per-token-loss denominator."""
    losses = [torch.tensor([5.0, 7.0]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]
    masks = [torch.zeros(2), torch.tensor([1.0, 1.0, 0.0]), torch.ones(1)]
    assert aggregate_loss(losses, masks, "token_mean").item() == pytest.approx((1 + 2 + 4) / 3)
    # upstream's denominator would be sum(clamp_min(mask.sum(), 1)) = 1 + 2 + 1 = 4
    assert aggregate_loss(losses, masks, "token_mean").item() != pytest.approx(7 / 4)
    assert aggregate_loss(losses, masks, "sample_mean").item() == pytest.approx((0 + 1.5 + 4) / 3)


def test_loss_agg_mode_follows_calculate_per_token_loss(base_args):
    assert loss_agg_mode(base_args.replace(calculate_per_token_loss=True)) == "token_mean"
    assert loss_agg_mode(base_args) == "sample_mean"


def test_sft_loss_is_negative_masked_mean_log_likelihood():
    lp = torch.tensor([-0.5, -1.5, -7.0], requires_grad=True)
    loss = sft_loss(lp, torch.tensor([1, 1, 0]))
    assert loss.item() == pytest.approx(1.0)
    loss.backward()
    np.testing.assert_allclose(lp.grad.numpy(), [-0.5, -0.5, 0.0])


# ------------------------------------------------------------------ TIS ----
def test_tis_clamps_detaches_and_reports_metrics():
    old = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0], requires_grad=True)
    rollout = torch.log(torch.tensor([0.25, 1.0, 2.0, 0.1, 1.0]))  # raw w = 4, 1, 0.5, 10, 1
    mask = torch.tensor([1, 1, 1, 1, 0])
    w, m = compute_tis_weights(old, rollout, mask, clip_high=2.0, clip_low=0.6)
    np.testing.assert_allclose(w.numpy(), [2.0, 1.0, 0.6, 2.0, 1.0], rtol=1e-6)
    assert not w.requires_grad
    assert m["tis_clipfrac"] == pytest.approx(3 / 4)
    ws = [2.0, 1.0, 0.6, 2.0]
    assert m["tis_ess"] == pytest.approx(sum(ws) ** 2 / (4 * sum(v * v for v in ws)), rel=1e-6)
    assert m["tis_weight_mean"] == pytest.approx(sum(ws) / 4, rel=1e-6)
    assert m["tis_raw_weight_mean"] == pytest.approx((4 + 1 + 0.5 + 10) / 4, rel=1e-5)
    # applied multiplicatively: gradient flows through the pg loss, scaled by w
    logp = torch.zeros(5, requires_grad=True)
    pg, _ = compute_policy_loss(logp, torch.zeros(5), torch.ones(5), 0.2)
    aggregate_loss(pg * w, mask, "token_mean").backward()
    np.testing.assert_allclose(logp.grad.numpy(), [-2 / 4, -1 / 4, -0.6 / 4, -2 / 4, 0.0], rtol=1e-6)


def test_tis_on_policy_weights_one_and_ess_one():
    lp = torch.tensor([-0.3, -2.0, -1.1])
    w, m = compute_tis_weights(lp, lp.clone(), torch.ones(3), clip_high=2.0)
    assert torch.equal(w, torch.ones(3))
    assert m["tis_ess"] == 1.0 and m["tis_clipfrac"] == 0.0
    assert compute_ess(torch.full((4,), 0.3), torch.ones(4)) == pytest.approx(1.0)
    # one dominating weight: ESS -> about 1/n
    assert compute_ess(torch.tensor([1000.0, 1e-3, 1e-3, 1e-3]), torch.ones(4)) == pytest.approx(0.25, rel=1e-3)
    assert compute_ess(torch.ones(3), torch.zeros(3)) == 1.0
    with pytest.raises(ValueError, match="tis-clip"):
        compute_tis_weights(lp, lp, torch.ones(3), clip_high=0.5, clip_low=1.0)


def test_tis_per_token_versions_cross_stage():
    """A resumed partial (2 tokens of v0, 2 of v1 == the old policy): only the v0 tokens are reweighted."""
    old = torch.tensor([-1.0, -1.0, -0.5, -0.7])
    rollout = torch.tensor([-1.5, -0.8, -0.5, -0.7])
    w, m = compute_tis_weights(old, rollout, torch.ones(4), clip_high=5.0)
    np.testing.assert_allclose(w.numpy(), [math.exp(0.5), math.exp(-0.2), 1.0, 1.0], rtol=1e-6)
    assert 0 < m["tis_ess"] < 1
