"""`--over-sampling-batch-size auto`."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from slime.arguments import parse_args
from slime.rollout.simulator import EngineCostModel, ParetoLengths, SimConfig, simulate
from slime.rollout.simulator.planner import OverSamplingPlanner, step_observations
from slime.utils.types import Sample, Status

FLAT = EngineCostModel(decode_base_s=0.01, decode_per_seq_s=1e-5, prefill_per_token_s=1e-6, abort_s=0.01,
                       request_latency_s=0.001, step_overhead_s=0.0, name="flat")


def _argv(base_args, *extra):
    return ["--hf-checkpoint", base_args.hf_checkpoint, "--prompt-data", base_args.prompt_data, "--rm-type", "math",
            "--num-rollout", "1", "--run-dir", base_args.run_dir, *extra]


def test_flag_accepts_auto_and_refuses_nonsense(base_args, tmp_path):
    a = parse_args(_argv(base_args, "--rollout-batch-size", "8", "--partial-rollout", "--over-sampling-batch-size", "auto"))
    assert a.over_sampling_batch_size == "auto"
    assert parse_args(_argv(base_args, "--rollout-batch-size", "8")).over_sampling_batch_size == 8
    with pytest.raises(SystemExit):
        parse_args(_argv(base_args, "--rollout-batch-size", "8", "--over-sampling-batch-size", "lots"))
    with pytest.raises(ValueError, match="--over-sampling-batch-size.*pool"):
        parse_args(_argv(base_args, "--rollout-batch-size", "8", "--over-sampling-batch-size", "auto", "--rollout-mode", "pool"))
    with pytest.raises(ValueError, match="--rollout-cost-model"):
        parse_args(_argv(base_args, "--rollout-batch-size", "8", "--rollout-cost-model", "gpu:h100:qwen3-4b:tp1"))
    with pytest.raises(ValueError, match="--rollout-cost-model"):
        parse_args(_argv(base_args, "--rollout-batch-size", "8", "--over-sampling-batch-size", "auto",
                         "--rollout-cost-model", str(tmp_path / "missing.json")))
    a = parse_args(_argv(base_args, "--rollout-batch-size", "8", "--over-sampling-batch-size", "auto",
                         "--rollout-cost-model", "gpu:h100:qwen3-4b:tp1"))
    assert OverSamplingPlanner.from_args(a).cost.name.startswith("Qwen3-4B on 1 x H100")


def _sample(gid, idx, resp, finished):
    s = Sample(index=idx, group_index=gid, tokens=[1, 2, 3] + [5] * resp, response_length=resp, loss_mask=[1] * resp,
               rollout_log_probs=[0.0] * resp, weight_versions=[0] * resp)
    s.status = Status.COMPLETED if finished else Status.ABORTED
    return s


def test_step_observations_count_each_final_length_once_and_censor_the_rest():
    groups = {
        1: SimpleNamespace(samples=[_sample(1, 0, 4, True), _sample(1, 1, 6, True)], outcome="accepted"),
        2: SimpleNamespace(samples=[_sample(2, 2, 9, True), _sample(2, 3, 2, True)], outcome="rejected"),
        3: SimpleNamespace(samples=[_sample(3, 4, 30, False), _sample(3, 5, 7, True)], outcome=None),
        4: SimpleNamespace(samples=[_sample(4, 6, 1, True), _sample(4, 7, 1, True)], outcome="rejected"),
    }
    step = SimpleNamespace(groups=groups, rejected={2: "zero_std", 4: "reward_unsettled"})
    obs = step_observations(step)
    assert sorted(obs["finished"]) == [1, 1, 2, 4, 6, 9]
    assert obs["unfinished"] == [30]  # the parked group's finished member waits until its group is final
    assert obs["passed"] == 1 and obs["rejected"] == 1  # an unsettled reward is not the filter's verdict
    assert obs["prompts"] == [3, 3, 3, 3]


def _observe_from_sim(planner, lengths, steps=4, seed=0):
    """Feed the planner what a few steps of a workload look like (finished lengths, censored unfinished)."""
    rng = random.Random(seed)
    for _ in range(steps):
        finished, unfinished = [], []
        for _ in range(planner.batch * 2):
            _, g = lengths.sample_group(rng, 4)
            cut = rng.choice([64, 128, 256])  # when the step stopped, relative to this group
            if max(g) <= cut:
                finished += g
            else:
                unfinished += [min(x, cut) for x in g if x > cut]
        planner.observe({"finished": finished, "unfinished": unfinished, "passed": planner.batch, "rejected": 0,
                         "prompts": [6] * 8})


def _args(base_args, batch=8):
    return base_args.replace(rollout_batch_size=batch, n_samples_per_prompt=4, partial_rollout=True,
                             over_sampling_batch_size="auto", rollout_max_response_len=1024,
                             sglang_server_concurrency=32, rollout_ignore_eos=True)


def test_auto_is_within_five_percent_of_the_best_fixed_size_on_the_same_workload(base_args):
    args = _args(base_args)
    lengths = ParetoLengths(alpha=1.0, scale=8, cap_steps=128)
    planner = OverSamplingPlanner.from_args(args, cost_model=FLAT)
    assert planner.size() == 16  # no observation yet: 2 x batch
    _observe_from_sim(planner, lengths)
    planner.plan()
    sweep = {}
    for size in planner.candidates():
        cfg = SimConfig.from_args(args, over_sampling_batch_size=size, steps=14, warmup_steps=4, seed=7)
        sweep[size] = simulate(cfg, FLAT, lengths).summary()["tokens_per_s"]
    best = max(sweep.values())
    assert min(sweep) <= planner.size() <= max(sweep)
    assert sweep[planner.size()] >= 0.95 * best, (planner.size(), sweep)
    assert planner.size() > args.rollout_batch_size  # a long tail on a flat-cost engine: over-sample
    m = planner.metrics()
    assert m["rollout/over_sampling_predicted_tokens_per_s"] > 0 and 0 < m["rollout/over_sampling_pass_rate"] <= 1


def test_auto_does_not_over_sample_when_nothing_has_a_tail_and_resuming_is_dear(base_args):
    args = _args(base_args)
    # no tail to cut, and a parked sample's re-prefill costs more than decoding it did: over-sampling only loses
    planner = OverSamplingPlanner.from_args(args, cost_model=FLAT.replace(prefill_per_token_s=2e-3))
    for _ in range(3):
        planner.observe({"finished": [64] * 64, "unfinished": [], "passed": 8, "rejected": 0, "prompts": [6]})
    planner.plan()
    assert planner.size() == args.rollout_batch_size


def test_planner_learns_the_filter_pass_rate(base_args):
    planner = OverSamplingPlanner.from_args(_args(base_args), cost_model=FLAT)
    for _ in range(4):
        planner.observe({"finished": [10] * 8, "unfinished": [], "passed": 4, "rejected": 12, "prompts": [6]})
    assert planner.pass_rate() == pytest.approx(17 / 65)
