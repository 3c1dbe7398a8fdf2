"""The length guard (slime/rollout/staleness.py's restart budget)."""

from __future__ import annotations

import pytest

from slime.arguments.base import ArgumentError
from slime.rollout.simulator import SimConfig, simulate
from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.staleness import GUARD_RESTART_BUDGET, StalenessCap

FLAT = EngineCostModel(decode_base_s=0.01, decode_per_seq_s=1e-5, prefill_per_token_s=1e-6, abort_s=0.01,
                       step_overhead_s=0.02, name="flat")
SHORT, LONG, HARD_SHARE = 8, 60, 0.2
STEPS, WARMUP, MAX_STALENESS = 40, 10, 1


class HardAndEasy:
    """The crafted task: a prompt is hard (all its samples LONG tokens) with probability HARD_SHARE, else easy."""

    cap = LONG

    def sample_group(self, rng, n):
        return 16, [LONG if rng.random() < HARD_SHARE else SHORT] * n

    def describe(self):
        return f"{HARD_SHARE:.0%} of prompts {LONG} tokens, the rest {SHORT}"


def longest_decile_share(res) -> float:
    """P_trained(length >= the synchronous p90) / P_sync(the same), over the measured steps."""
    trained = [x for s in res.measured() for x in s["trained_lengths"]]
    return sum(x >= LONG for x in trained) / len(trained) / HARD_SHARE


def run(restart_budget):
    cfg = SimConfig(rollout_batch_size=8, n_samples_per_prompt=8, over_sampling_batch_size=16, partial_rollout=True,
                    max_response_len=LONG, max_staleness=MAX_STALENESS, staleness_policy="restart",
                    restart_budget=restart_budget, steps=STEPS, warmup_steps=WARMUP, seed=3)
    return simulate(cfg, FLAT, HardAndEasy())


@pytest.fixture(scope="module")
def runs():
    return {"off": run(None), "on": run(GUARD_RESTART_BUDGET)}


def test_without_the_guard_the_restart_cap_starves_the_long_tail(runs):
    off = runs["off"]
    assert longest_decile_share(off) < 0.6
    assert sum(s["staleness"]["restart"] for s in off.steps) > 0
    assert not any(s["staleness"]["guard_masked"] for s in off.steps)


def test_the_guard_trains_the_long_tail_as_a_synchronous_run_would(runs):
    on = runs["on"]
    assert longest_decile_share(on) >= 0.9
    assert sum(s["staleness"]["guard_masked"] for s in on.steps) > 0
    assert not any(s["staleness"]["restart"] for s in on.steps)
    assert sum(s["staleness"]["masked_tokens"] for s in on.steps) > 0
    samples_per_s = {arm: sum(len(s["trained_lengths"]) for s in r.measured()) / r.summary()["rollout_s"]
                     for arm, r in runs.items()}
    assert samples_per_s["on"] > samples_per_s["off"]  # restarts regenerate, masking does not


@pytest.mark.parametrize("arm", ["off", "on"])
def test_both_keep_the_cap_the_ledger_and_parked_first(runs, arm):
    res = runs[arm]
    # no token older than --max-staleness is trained uncorrected (the histogram counts tokens in the loss)
    assert max(lag for s in res.steps for lag in s["lag_tokens"]) <= MAX_STALENESS
    # the ledger balanced at the end (checked by the simulator) and each accepted group trained once
    assert res.ledger["trained"] == STEPS * 8 and res.ledger["issued"] == 0
    # parked groups resume first: a step that hands out groups while some are parked takes those back first
    for before, s in zip(res.steps, res.steps[1:]):
        if before.get("parked", 0) and s["submitted_groups"]:
            assert s["resumed_groups"] >= min(before["parked"], 16), (before, s)


def test_the_flag_turns_the_guard_off_and_the_simulator_follows_it(parse_with):
    on = parse_with(max_staleness=4, partial_rollout=True, over_sampling_batch_size=16)
    off = parse_with(max_staleness=4, partial_rollout=True, over_sampling_batch_size=16, disable_length_guard=True)
    assert StalenessCap.from_args(on).restart_budget == GUARD_RESTART_BUDGET and StalenessCap.from_args(on).guarded
    assert StalenessCap.from_args(off).restart_budget is None and not StalenessCap.from_args(off).guarded
    # --over-sampling-batch-size auto plans with SimConfig.from_args: the same cap as the run's
    assert SimConfig.from_args(on).restart_budget == GUARD_RESTART_BUDGET
    assert SimConfig.from_args(off).restart_budget is None
    with pytest.raises(ArgumentError, match="--disable-length-guard"):
        parse_with(staleness_policy="mask", max_staleness=4, disable_length_guard=True)
