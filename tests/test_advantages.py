"""Advantage estimators checked against independent numpy / python-float computations."""

import math

import numpy as np
import pytest
import torch

from slime.utils.advantages import (
    compute_advantages,
    discounted_returns,
    group_relative_rewards,
    normalize_advantages,
)
from slime.utils import ppo_utils

torch.set_num_threads(1)


def _masks(lengths, zero_at=()):
    out = []
    for i, n in enumerate(lengths):
        m = torch.ones(n)
        for (j, t) in zero_at:
            if j == i:
                m[t] = 0
        out.append(m)
    return out


def _np_whiten(values_per_sample, masks_per_sample):
    flat = np.concatenate([np.asarray(v, dtype=np.float64)[np.asarray(m) != 0]
                           for v, m in zip(values_per_sample, masks_per_sample)])
    mean = flat.mean()
    var = flat.var(ddof=1)
    return [np.where(np.asarray(m) != 0, (np.asarray(v, dtype=np.float64) - mean) / math.sqrt(var + 1e-8), 0.0)
            for v, m in zip(values_per_sample, masks_per_sample)]


def test_grpo_matches_numpy_group_statistics():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.25, 0.0, 1.0]
    lengths = [3, 1, 4, 2, 5, 2, 3, 1]
    masks = _masks(lengths, zero_at=[(0, 1), (4, 0)])
    advs = compute_advantages("grpo", torch.tensor(rewards), 4, masks)
    r = np.array(rewards).reshape(2, 4)
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    expected = expected.reshape(-1)
    for i, (a, m) in enumerate(zip(advs, masks)):
        assert a.shape == (lengths[i],)
        np.testing.assert_allclose(a.numpy(), expected[i] * m.numpy(), rtol=1e-5, atol=1e-7)
    # masked-out positions are exactly zero
    assert advs[0][1].item() == 0.0 and advs[4][0].item() == 0.0


def test_grpo_without_std_normalization_is_mean_centered():
    rewards = torch.tensor([3.0, 1.0, 2.0, 10.0])
    got = group_relative_rewards(rewards, 2, normalize_std=False)
    assert got.tolist() == [1.0, -1.0, -4.0, 4.0]
    advs = compute_advantages("grpo", rewards, 2, _masks([2, 2, 2, 2]), normalize_std=False)
    assert advs[3].tolist() == [4.0, 4.0]


def test_grpo_single_sample_groups_and_equal_rewards_give_zero_not_nan():
    single = compute_advantages("grpo", torch.tensor([0.7, -3.0, 5.0]), 1, _masks([2, 3, 1]))
    for a in single:
        assert torch.equal(a, torch.zeros_like(a))
    equal = compute_advantages("grpo", torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), 3, _masks([2] * 6))
    for a in equal:
        assert torch.isfinite(a).all() and torch.equal(a, torch.zeros_like(a))


def _upstream_group_norm(rewards: torch.Tensor, group_size: int, std_norm: bool) -> torch.Tensor:
    """Upstream slime's group normalisation (RolloutManager._post_process_rewards), float32."""
    r = rewards.reshape(-1, group_size)
    r = r - r.mean(dim=-1, keepdim=True)
    if std_norm:
        r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return r.flatten()


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # size-1 groups in the upstream reference (all "equal")
def test_equal_reward_groups_get_exactly_zero_for_any_value_and_size():
    """A group of equal rewards has advantage exactly 0 for every centring estimator; other groups are untouched."""
    rng = np.random.default_rng(0)
    # the cases: float32 mean residue / (std + 1e-6) used to give -0.32 and 0.03
    for value in (7.7, 0.3):
        assert torch.equal(group_relative_rewards(torch.full((8,), value), 8), torch.zeros(8))
    for trial in range(300):
        size = int(rng.integers(1, 17))
        n_groups = int(rng.integers(1, 6))
        groups = []
        for _ in range(n_groups):
            if rng.random() < 0.5:
                groups.append(np.full(size, rng.choice([rng.normal() * 10.0 ** rng.integers(-3, 4), 0.1, 1 / 3, -2.7])))
            else:
                groups.append(rng.normal(size=size) * 10.0 ** rng.integers(-3, 4))
        rewards = torch.tensor(np.concatenate(groups), dtype=torch.float32)
        grouped = rewards.view(n_groups, size)
        equal = (grouped == grouped[:, :1]).all(dim=1)
        for std_norm in (True, False):
            got = group_relative_rewards(rewards, size, normalize_std=std_norm).view(n_groups, size)
            assert torch.equal(got[equal], torch.zeros_like(got[equal])), (trial, std_norm)
            # every other group: bit for bit what upstream computes
            want = _upstream_group_norm(rewards, size, std_norm).view(n_groups, size)
            assert torch.equal(got[~equal], want[~equal]), (trial, std_norm)
        masks = _masks([3] * rewards.numel())
        for estimator in ("grpo", "gspo"):
            advs = compute_advantages(estimator, rewards, size, masks)
            for g in torch.nonzero(equal).flatten().tolist():
                assert all(torch.equal(advs[g * size + j], torch.zeros(3)) for j in range(size))


def test_reinforce_pp_baseline_equal_groups_center_to_zero_before_whitening():
    rewards = torch.tensor([7.7] * 4 + [1.0, 0.0, 0.0, 0.0])
    masks = _masks([2] * 8)
    advs = compute_advantages("reinforce_plus_plus_baseline", rewards, 4, masks)
    assert torch.equal(group_relative_rewards(rewards, 4, normalize_std=False)[:4], torch.zeros(4))
    centered = np.array([0.0] * 4 + [0.75, -0.25, -0.25, -0.25])  # the equal group's residue is gone
    expected = _np_whiten([[c, c] for c in centered], [m.numpy() for m in masks])
    for a, e in zip(advs, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
    assert len({round(float(a[0]), 6) for a in advs[:4]}) == 1


def test_gspo_uses_grpo_advantages():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.2])
    masks = _masks([3, 2, 1, 4])
    for a, b in zip(compute_advantages("gspo", rewards, 2, masks), compute_advantages("grpo", rewards, 2, masks)):
        assert torch.equal(a, b)


def test_group_size_mismatch_names_the_flag():
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        compute_advantages("grpo", torch.tensor([1.0, 2.0, 3.0]), 2, _masks([1, 1, 1]))
    with pytest.raises(ValueError, match="advantage-estimator"):
        compute_advantages("ppo_with_critic", torch.tensor([1.0]), 1, _masks([1]))


def test_discounted_returns_by_hand():
    r = torch.tensor([1.0, 0.0, 2.0, -1.0])
    g = 0.5
    # G3 = -1; G2 = 2 - 0.5 = 1.5; G1 = 0 + 0.75 = 0.75; G0 = 1 + 0.375
    assert discounted_returns(r, g).tolist() == [1.375, 0.75, 1.5, -1.0]


def _np_reinforce_pp(rewards, kls, masks, kl_coef, gamma):
    returns = []
    for r, kl, m in zip(rewards, kls, masks):
        m = [float(x) for x in m]
        tok = [-kl_coef * float(k) * mm for k, mm in zip(kl, m)]
        idx = [t for t, mm in enumerate(m) if mm != 0]
        if idx:
            tok[idx[-1]] += r
        g, out = 0.0, [0.0] * len(tok)
        for t in reversed(range(len(tok))):
            g = tok[t] + gamma * g
            out[t] = g * m[t]
        returns.append(out)
    return _np_whiten(returns, masks)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop_reference(gamma):
    gen = torch.Generator().manual_seed(0)
    lengths = [4, 2, 6, 3]
    rewards = torch.tensor([1.0, 0.0, 0.5, -1.0])
    masks = _masks(lengths, zero_at=[(2, 5), (2, 0), (0, 2)])  # sample 2's last token masked
    kls = [torch.rand(n, generator=gen) * 0.3 for n in lengths]
    got = compute_advantages("reinforce_plus_plus", rewards, 2, masks, kl=kls, kl_coef=0.1, gamma=gamma)
    expected = _np_reinforce_pp(rewards.tolist(), [k.tolist() for k in kls], masks, 0.1, gamma)
    for a, e in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
    flat = torch.cat([a[m != 0] for a, m in zip(got, masks)])
    assert abs(flat.mean().item()) < 1e-6
    assert abs(flat.std().item() - 1.0) < 1e-4


def test_reinforce_plus_plus_kl_changes_advantages_and_zero_kl_is_noop():
    masks = _masks([3, 3])
    rewards = torch.tensor([1.0, 0.0])
    no_kl = compute_advantages("reinforce_plus_plus", rewards, 1, masks)
    zero_kl = compute_advantages("reinforce_plus_plus", rewards, 1, masks, kl=[torch.zeros(3)] * 2, kl_coef=0.5)
    big_kl = compute_advantages("reinforce_plus_plus", rewards, 1, masks,
                                kl=[torch.tensor([2.0, 0.0, 0.0]), torch.zeros(3)], kl_coef=0.5)
    for a, b in zip(no_kl, zero_kl):
        torch.testing.assert_close(a, b)
    # a KL penalty on sample 0's first token lowers that token's (whitened) advantage rank
    assert big_kl[0][0] < big_kl[0][1]
    assert no_kl[0][0] == no_kl[0][1]


def test_reinforce_plus_plus_baseline_matches_numpy():
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    lengths = [2, 3, 1, 2, 2, 4]
    masks = _masks(lengths, zero_at=[(5, 3)])
    got = compute_advantages("reinforce_plus_plus_baseline", torch.tensor(rewards), 3, masks)
    r = np.array(rewards).reshape(2, 3)
    centered = (r - r.mean(1, keepdims=True)).reshape(-1)
    per_tok = [np.full(n, centered[i]) * m.numpy() for i, (n, m) in enumerate(zip(lengths, masks))]
    expected = _np_whiten(per_tok, masks)
    for a, e in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)


def test_normalize_advantages_masked_whitening_and_edge_cases():
    advs = [torch.tensor([1.0, 100.0, 3.0]), torch.tensor([5.0, float("nan")])]
    masks = [torch.tensor([1, 0, 1]), torch.tensor([1, 0])]
    got = normalize_advantages(advs, masks)
    expected = _np_whiten([[1.0, 0.0, 3.0], [5.0, 0.0]], [m.numpy() for m in masks])
    for a, e in zip(got, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
    # hand value: mean 3, unbiased var 4 -> (1-3)/2 = -1
    assert got[0][0].item() == pytest.approx(-1.0, abs=1e-6)
    # an all-zero mask gives zeros, never NaN
    empty = normalize_advantages([torch.tensor([1.0, 2.0])], [torch.zeros(2)])
    assert torch.equal(empty[0], torch.zeros(2))
    # a single token: mean removed, no division by an undefined std
    one = normalize_advantages([torch.tensor([4.0, 9.0])], [torch.tensor([0, 1])])
    assert one[0].tolist() == [0.0, 0.0]


def test_normalize_advantages_all_reduce_single_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        advs = [torch.tensor([1.0, 2.0, 4.0])]
        masks = [torch.ones(3)]
        torch.testing.assert_close(normalize_advantages(advs, masks, all_reduce=True)[0],
                                   normalize_advantages(advs, masks)[0])
    finally:
        dist.destroy_process_group()


def test_ppo_utils_reexports_advantage_api():
    assert ppo_utils.compute_advantages is compute_advantages
    assert ppo_utils.normalize_advantages is normalize_advantages


def _args(tmp_path, *extra):
    from slime.arguments import parse_args

    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "d.jsonl").write_text("")
    return parse_args(["--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(tmp_path / "d.jsonl"),
                       "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--n-samples-per-prompt", "2", "--global-batch-size", "4", *extra])


def test_the_trainers_advantages_read_the_flags(tmp_path):
    """training_utils/loss.py's advantages from the parsed flags."""
    from types import SimpleNamespace

    from slime.backends.training_utils.loss import _advantages

    masks = _masks([2, 1, 3, 2])
    groups = [[SimpleNamespace(reward=1.0), SimpleNamespace(reward=0.0)], [SimpleNamespace(reward=3.0), SimpleNamespace(reward=3.0)]]
    plain = _advantages(_args(tmp_path), "grpo", groups, masks, None, 0.0)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)  # (1 - 0.5) / unbiased std of {1, 0}
    assert plain[0].tolist() == pytest.approx([s, s]) and plain[2].tolist() == [0.0, 0.0, 0.0]
    no_std = _advantages(_args(tmp_path, "--disable-grpo-std-normalization"), "grpo", groups, masks, None, 0.0)
    assert no_std[0].tolist() == [0.5, 0.5] and no_std[1].tolist() == [-0.5]
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    rpp = _advantages(_args(tmp_path, "--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1"),
                      "reinforce_plus_plus", groups, masks, [torch.ones(n) for n in (2, 1, 3, 2)], 0.1)
    expected = _np_reinforce_pp(rewards.tolist(), [[1.0] * n for n in (2, 1, 3, 2)], masks, 0.1, 1.0)
    for a, e in zip(rpp, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=1e-5, atol=1e-6)
