"""Plugins written to upstream slime's contract (tests/upstream_plugins.py) through the APRIL step and quickstart.sh."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from slime.backends.training_utils.data import flatten_groups, split_steps
from slime.rollout.buffer import PartialRolloutBuffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
from slime.utils.ledger import FINISHED, TRAINED
from slime.utils.plugin_args import plugin_args
from slime.utils.types import Status

from test_sglang_rollout import env, make_args, set_version  # noqa: F401 (the module's engine fixture)
from upstream_plugins import FIRST_TURN

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGINS = "tests.upstream_plugins"


def step(env, args, source, buffer, rollout_id):
    set_version(env, rollout_id)
    out = generate_rollout(plugin_args(args), rollout_id, engine_rollout(args, buffer, source, env["engines"], policy_version=rollout_id).context())
    buffer.mark([g[0].group_index for g in out.groups], TRAINED)
    return out


def test_a_generate_continuing_from_sample_tokens_resumes_like_the_default_one(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path),
                     "--custom-generate-function-path", f"{PLUGINS}.generate_with_state")
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    parked: dict[int, list[int]] = {}
    for rollout_id in range(12):  # whether an abort catches a sample mid-generation is timing: step until it does
        out = step(env, args, source, buffer, rollout_id)
        for g in out.groups:
            for s in g:
                if s.index in parked:  # a resumed sample: its parked tokens, then tokens of a later policy
                    before = parked.pop(s.index)
                    assert s.tokens[:len(before)] == before and len(s.tokens) > len(before)
                    assert s.weight_versions == sorted(s.weight_versions) and s.weight_versions[-1] == rollout_id
                    assert s.weight_versions[0] < rollout_id
                    return
        assert all(s.status.is_finished and s.reward is not None for g in out.groups for s in g)
        parked.update({s.index: list(s.tokens) for g in buffer._parked for s in g
                       if s.response_length and not s.status.is_finished})
    pytest.fail("no partly generated sample was parked and resumed in 12 steps")


def test_multi_turn_plugin_trains_model_tokens_not_tool_tokens(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path),
                     "--custom-generate-function-path", f"{PLUGINS}.generate_multi_turn",
                     "--rollout-max-context-len", "20")
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    tool_id = env["tok"].encode(",", add_special_tokens=False)
    seen = 0
    for rollout_id in range(3):
        for g in step(env, args, source, buffer, rollout_id).groups:
            for s in g:
                assert len(s.tokens) <= 20  # --rollout-max-context-len
                if not getattr(s, "tool_called", False):
                    assert 0 not in s.loss_mask  # answered before the tool
                    continue
                seen += 1
                tool = slice(FIRST_TURN, FIRST_TURN + len(tool_id))
                assert s.response_tokens[tool] == tool_id and s.loss_mask[tool] == [0] * len(tool_id)
                assert s.rollout_log_probs[tool] == [0.0] * len(tool_id)
                model = s.loss_mask[:FIRST_TURN] + s.loss_mask[tool.stop:]
                assert model == [1] * len(model) and s.effective_response_length == s.response_length - len(tool_id)
                assert s.status in (Status.COMPLETED, Status.TRUNCATED)
    assert seen > 0
    assert plugin_args(args).upstream_tool_calls >= seen  # state the plugin kept on the args it was given


def test_a_removed_sample_stays_in_its_group_and_out_of_the_loss(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path),
                     "--custom-generate-function-path", f"{PLUGINS}.generate_removing_odd")
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    for rollout_id in range(2):
        out = step(env, args, source, buffer, rollout_id)  # the ledger takes every group as trained
        assert out.metrics["rollout/removed_samples"] == 3  # one of each group's two samples
        items, failed = flatten_groups(out.groups)
        assert failed == 0 and [len(g) for g in items] == [2, 2, 2]  # removed samples stay in their group
        for g, gi in zip(out.groups, items):
            for s, it in zip(g, gi):
                assert s.reward is not None and it.reward == s.reward  # rewarded: in the group's normalization
                assert it.loss_mask.tolist() == ([0] * s.response_length if s.index % 2 else s.loss_mask)
                assert (s.version_counts() == {}) is bool(s.index % 2)  # nor in rollout/trained_tokens
    assert buffer.ledger_summary()[TRAINED] == 6


def test_generate_state_aborted_is_true_while_the_step_aborts(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path),
                     "--custom-generate-function-path", f"{PLUGINS}.generate_turns_until_aborted")
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    stopped: dict[int, list[int]] = {}
    for rollout_id in range(12):  # whether the abort finds a sample between two turns is timing: step until it does
        out = step(env, args, source, buffer, rollout_id)
        for g in out.groups:
            for s in g:
                if s.index in stopped:  # it went on from the tokens it had when it stopped
                    assert s.tokens[:len(stopped[s.index])] == stopped[s.index] and s.status.is_finished
                    return
        stopped.update({s.index: list(s.tokens) for g in buffer._parked for s in g
                        if getattr(s, "stopped_between_turns", False)})
    pytest.fail(f"no sample stopped between turns at an abort and resumed in 12 steps (stopped: {sorted(stopped)})")


def test_a_list_returning_generate_trains_every_sample_and_the_ledger_counts_them(env, tmp_path):
    args = make_args(env["root"], "--run-dir", str(tmp_path), "--custom-rm-path", f"{PLUGINS}.dapo_reward",
                     "--custom-generate-function-path", f"{PLUGINS}.generate_fanout")
    source, buffer = RolloutDataSource(args, env["tok"]), PartialRolloutBuffer(args)
    set_version(env, 0)
    out = generate_rollout(plugin_args(args), 0, engine_rollout(args, buffer, source, env["engines"], policy_version=0).context())
    assert len(out.groups) == 3
    for g in out.groups:
        assert len(g) == 4 and len({s.group_index for s in g}) == 1  # 2 samples made of each of the 2
        assert all(s.status.is_finished and s.reward in (1.0, -1.0) for s in g)
        assert all(len(s.weight_versions) == s.response_length > 0 for s in g)
        assert buffer.group_state(g[0].group_index) == FINISHED  # one group, settled once
    assert buffer.ledger_summary()[FINISHED] == 3
    assert plugin_args(args).upstream_rewards == 12  # 12 samples: 6 rewarded by the plugin, 6 by --custom-rm-path
    # the two samples made of one share its rollout_id: one rollout, one optimizer step, one sample-mean term
    items = [it for g in flatten_groups(out.groups)[0] for it in g]
    assert len({it.rollout for it in items}) == 6
    steps = split_steps([it.rollout for it in items], 2)
    assert [len(p) for p in steps] == [4, 4, 4] and all(items[p].rollout_id is not None for p in steps[0])


# ---- the quick start, as a user runs it with these plugins --------------------------------------------------------
def quickstart(tmp_path, *argv, **env):
    run = tmp_path / "run"
    env = {**os.environ, "RUN": str(run), "STEPS": "3", "EVAL_INTERVAL": "1000", "SIMULATE": "0",
           "PYTHONUNBUFFERED": "1", "SLIME_SKIP_INSTALL": "1", "PYTHONPATH": REPO, **env}
    out = subprocess.run(["bash", os.path.join(REPO, "scripts/quickstart.sh"), *argv, "--skip-eval-before-train"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(1800)
def test_quickstart_with_upstream_plugins_april(tmp_path, quickstart_task):
    rows = quickstart(tmp_path, "--custom-generate-function-path", f"{PLUGINS}.generate_removing_odd",
                      "--custom-rm-path", f"{PLUGINS}.dapo_reward", "--rollout-max-context-len", "256",
                      "--buffer-filter-path", f"{PLUGINS}.longest_first",
                      "--dynamic-sampling-filter-path", f"{PLUGINS}.rewards_differ")
    steps = [r for r in rows if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert all(r["rollout/groups_accepted"] == 8 and r["train/grad_norm"] >= 0 for r in steps)
    assert sum(r["rollout/groups_parked"] for r in steps) > 0  # APRIL parked groups, the 4-argument filter resumed them
    assert any(r["rollout/groups_resumed"] > 0 for r in steps)
    assert all(-1.0 <= r["reward/mean"] <= 1.0 for r in steps)  # math_dapo_utils' +1 / -1
    assert all(0 < r["rollout/removed_samples"] < r["rollout/samples"] for r in steps)  # trained out of the loss
