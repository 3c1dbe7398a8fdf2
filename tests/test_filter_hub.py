import textwrap

import pytest

from slime.rollout.filter_hub import DynamicFilterOutput, call_dynamic_filter
from slime.rollout.filter_hub.dynamic_sampling_filters import check_reward_nonzero_std
from slime.utils.misc import load_function
from slime.utils.types import Sample, Status

BUILTIN = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


def group(rewards, failed=()):
    out = []
    for i, r in enumerate(rewards):
        s = Sample(index=i, group_index=7, reward=r, status=Status.COMPLETED)
        if i in failed:
            s.status, s.reward = Status.FAILED, None
        out.append(s)
    return out




def test_mixed_rewards_kept(base_args):
    assert check_reward_nonzero_std(base_args, group([1.0, 0.0, 1.0, 1.0])) == DynamicFilterOutput(keep=True, reason=None)


@pytest.mark.parametrize("value", [1.0, 0.0, -1.0])
def test_equal_rewards_rejected_with_value(value, base_args):
    out = check_reward_nonzero_std(base_args, group([value] * 4))
    assert out.keep is False
    assert out.reason == f"all rewards equal (={value:g})"


def test_failed_samples_excluded(base_args):
    # the only differing reward belongs to a failed sample: the rest are all equal
    out = check_reward_nonzero_std(base_args, group([1.0, 1.0, 0.0, 1.0], failed={2}))
    assert (out.keep, out.reason) == (False, "all rewards equal (=1)")
    # failures do not hide real spread among the others
    assert check_reward_nonzero_std(base_args, group([1.0, 0.0, 0.0, 5.0], failed={3})).keep is True


def test_all_failed_rejected(base_args):
    out = check_reward_nonzero_std(base_args, group([0.0, 0.0], failed={0, 1}))
    assert (out.keep, out.reason) == (False, "all samples failed")


def test_dict_rewards_need_reward_key(base_args):
    samples = group([{"acc": 1.0, "len": 3}, {"acc": 0.0, "len": 3}])
    assert check_reward_nonzero_std(base_args.replace(reward_key="acc"), samples).keep is True
    assert check_reward_nonzero_std(base_args.replace(reward_key="len"), samples).keep is False
    with pytest.raises(ValueError, match="--reward-key"):
        check_reward_nonzero_std(base_args, samples)


def test_builtin_loads_by_dotted_path_and_keeps_contract(base_args):
    fn = load_function(BUILTIN)
    for rewards in ([1.0, 0.0], [0.5, 0.5]):
        out = fn(base_args, group(rewards))
        assert isinstance(out, DynamicFilterOutput)
    assert call_dynamic_filter(BUILTIN, base_args, group([0.0, 1.0])).keep is True


def test_plugin_contract_enforced(tmp_path, monkeypatch, base_args):
    (tmp_path / "my_filters.py").write_text(
        textwrap.dedent(
            """
            from slime.rollout.filter_hub.base_types import DynamicFilterOutput

            def long_enough(args, samples):
                ok = all(s.response_length >= args.rollout_max_response_len for s in samples)
                return DynamicFilterOutput(keep=ok, reason=None if ok else "too short")

            def returns_bool(args, samples):
                return len(samples) > 1

            def returns_text(args, samples):
                return "keep"
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    samples = group([1.0, 0.0])
    samples[0].append_response([5, 6, 7], [-0.1, -0.2, -0.3], 0)
    out = call_dynamic_filter("my_filters.long_enough", base_args.replace(rollout_max_response_len=2), samples)
    assert (out.keep, out.reason) == (False, "too short")
    samples[1].append_response([8, 9], [-0.1, -0.2], 0)
    assert call_dynamic_filter("my_filters.long_enough", base_args.replace(rollout_max_response_len=2), samples).keep is True
    # upstream reads a plain bool as DynamicFilterOutput(keep=...)
    assert call_dynamic_filter("my_filters.returns_bool", base_args, samples) == DynamicFilterOutput(keep=True)
    assert call_dynamic_filter("my_filters.returns_bool", base_args, samples[:1]) == DynamicFilterOutput(keep=False)
    with pytest.raises(TypeError, match="my_filters.returns_text returned str.*DynamicFilterOutput"):
        call_dynamic_filter("my_filters.returns_text", base_args, samples)
    with pytest.raises(ImportError, match="no_such_module"):
        call_dynamic_filter("no_such_module.f", base_args, samples)
