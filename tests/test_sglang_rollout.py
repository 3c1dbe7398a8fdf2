"""APRIL rollout end to end: the embedded engine behind the real sglang-router (tests/rollout_env.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from slime.ray.buffer import PartialRolloutBuffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
from slime.utils.ledger import FINISHED, PARKED, TRAINED
from slime.utils.types import Status

import rollout_env
from logprob_reference import teacher_forced
from rollout_env import (LongFirstSource, OverlongSource, RecordingSource, ShortAndLongSource, SlowFirstSource,
                         SlowRewardGate, StalledRewardGate, StalledSource, check_group_invariants, env, make_args,
                         run_steps, set_version)  # noqa: F401 (env: a fixture)

pytestmark = pytest.mark.slow
def test_april_steps_resume_parked_first_and_balance(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path))
    source, buffer, outs = run_steps(env, args, 4)
    trace = [json.loads(line) for line in open(tmp_path / "rollout_trace.jsonl")]
    assert len(trace) == 4
    returned = [s[0].group_index for o in outs for s in o.groups]
    assert len(returned) == len(set(returned)) == 12  # 3 per step, never a group twice
    parked: list[int] = []  # the buffer's parked groups, FIFO
    for step, (out, tr) in enumerate(zip(outs, trace)):
        check_group_invariants(out.groups, 2, source.prompts, step, 24)
        m = out.metrics
        # parked groups (FIFO) are submitted before any fresh one; a step whose target the groups finished
        # after the last one's (ready) already meet submits nothing
        assert tr["resumed"] == tr["submitted"][: len(tr["resumed"])] == parked[: len(tr["resumed"])]
        assert m["rollout/groups_resumed"] == len(parked) or m["rollout/groups_fresh"] == 0
        assert m["rollout/groups_submitted"] or m["rollout/groups_ready_in"] >= 3
        parked = parked[len(tr["resumed"]):] + tr["unfinished"]
        assert m["rollout/groups_accepted"] == 3 and m["rollout/in_flight_peak"] <= 6
        # exact off-policy ratio over the returned groups' loss-masked tokens
        toks = [(v, k) for g in out.groups for s in g for v, k in zip(s.weight_versions, s.loss_mask) if k]
        assert m["rollout/off_policy_token_ratio"] == pytest.approx(sum(v < step for v, _ in toks) / len(toks))
        assert sum(v for k, v in m.items() if k.startswith("rollout/staleness_hist/")) == len(toks)
        assert m["rollout/groups_parked"] == len(tr["unfinished"])
    # resumed samples really span versions, and their log-probs line up with the tokens (resumed from ids).
    # Whether a returned group holds a sample resumed across a bump within 4 steps is timing: step on until one does.
    def spanning():
        return [s for o in outs for g in o.groups for s in g if len(set(s.weight_versions)) > 1]

    version = 4
    while not spanning() and version < 10:
        outs += run_steps(env, args, 1, source=source, buffer=buffer, first_version=version)[2]
        version += 1
    multi = spanning()
    assert multi, "no returned sample was resumed across a version bump"
    assert max(o.metrics["rollout/versions_per_sample_max"] for o in outs) >= 2
    for s in multi[:4]:
        assert teacher_forced(env["model"], s) == pytest.approx(s.rollout_log_probs, abs=2e-4)
    summary = buffer.check_balanced()
    assert summary[TRAINED] == 3 * len(outs) and summary[PARKED] == buffer.num_parked()
    assert summary["total"] == len(source.prompts)  # every issued group is accounted for

    # save with groups parked, load into a new buffer: they come back with every per-token field. Whether the
    # groups parked at the last abort hold a partly generated sample is timing; step on until they do.
    def partly_generated(groups):
        return any(s.response_length and s.status == Status.ABORTED for g in groups for s in g)

    while not partly_generated(buffer._parked) and version < 16:
        run_steps(env, args, 1, source=source, buffer=buffer, first_version=version)
        version += 1
    path = tmp_path / "buffer.json"
    buffer.save(str(path))
    restored = PartialRolloutBuffer(args)
    restored.load(str(path))
    assert restored.ledger_summary() == buffer.ledger_summary()
    a, b = buffer.take_parked(100), restored.take_parked(100)
    assert [[s.to_dict() for s in g] for g in a] == [[s.to_dict() for s in g] for g in b]
    assert any(s.response_length and s.status == Status.ABORTED for g in b for s in g), \
        [[(s.status, s.response_length) for s in g] for g in b]


def test_april_tops_up_as_soon_as_requests_finish(env):
    """A chunk of 3 groups (= the target) with 6 requests allowed in flight."""
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "3",
                     "--rollout-max-response-len", "96").replace(rollout_ignore_eos=True)
    source, buffer, outs = run_steps(env, args, 2, source=ShortAndLongSource(make_args(env["root"]), env["tok"]))
    assert outs[0].metrics["rollout/groups_refilled"] >= 1  # the first step starts from fresh groups only
    for out in outs:  # (a step whose target the groups finished late in the one before meet submits nothing)
        m = out.metrics
        assert m["rollout/groups_refilled"] >= 1 or m["rollout/groups_submitted"] == 0, m
        assert m["rollout/in_flight_peak"] <= 6
        assert len(out.groups) == 3
    assert buffer.check_balanced()["total"] == len(source.prompts)


@pytest.mark.parametrize("mode", ["chunked", "pool"])
def test_a_stalled_reward_stops_the_step_submitting(env, mode):
    """While the rewards of a chunk's worth of rows (the pool's size) have not come back, the step adds no group."""
    flags = {"chunked": ["--over-sampling-batch-size", "3"], "pool": ["--rollout-mode", "pool", "--rollout-pool-size", "6"]}
    args = make_args(env["root"], "--partial-rollout", "--rm-type", "math", "--custom-rm-path", "rollout_env.stalled_rm",
                     *flags[mode])
    budget = 3 * args.n_samples_per_prompt  # a chunk of 3 groups; the pool's 6 (both within 6 in flight)
    rollout_env.STALL = gate = StalledRewardGate(budget)
    source, buffer, outs = run_steps(env, args, 1, source=StalledSource(args, env["tok"]), train=False)
    assert gate.released_by == "all_waiting", (gate.released_by, gate.waiting_at_hand_out)
    assert gate.waiting_at_hand_out and max(gate.waiting_at_hand_out) < budget, gate.waiting_at_hand_out
    # at most: what waited at the last hand-out (< budget), what was in flight or handed out then (a budget, rounded
    # up to whole groups), and the finished members of groups with a member in flight (< budget with 2 a group)
    assert budget <= gate.handed_out <= 3 * budget
    assert len(outs[0].groups) == 3 and buffer.check_balanced()["total"] == len(source.prompts)


def test_without_partial_rollout_unfinished_work_is_dropped_and_counted(env):
    args = make_args(env["root"], "--over-sampling-batch-size", "6")
    source, buffer, outs = run_steps(env, args, 2)
    for out in outs:
        m = out.metrics
        assert m["rollout/groups_parked"] == 0 and m["rollout/groups_resumed"] == 0
        assert m["rollout/groups_refilled"] == 0  # no top-ups: unfinished work would be thrown away
        dropped = m.get("rollout/groups_dropped/discarded_unfinished", 0)
        assert m["rollout/groups_dropped"] >= dropped
        check_group_invariants(out.groups, 2, source.prompts, 1, 24)
        assert all(len(set(s.weight_versions)) == 1 for g in out.groups for s in g)
    s = buffer.check_balanced()
    assert buffer.num_parked() == 0 and s[PARKED] == 0
    assert s.get("dropped/discarded_unfinished", 0) == sum(
        o.metrics.get("rollout/groups_dropped/discarded_unfinished", 0) for o in outs)
    assert s["total"] == len(source.prompts)


def test_pool_mode_keeps_pool_full_and_small_chunks_fill_target(env):
    args = make_args(env["root"], "--partial-rollout", "--rollout-mode", "pool", "--rollout-pool-size", "4",
                     "--rollout-batch-size", "4")
    source, buffer, outs = run_steps(env, args, 2)
    for out in outs:
        assert out.metrics["rollout/in_flight_peak"] == 4 and len(out.groups) == 4
        check_group_invariants(out.groups, 2, source.prompts, 1, 24)
    assert buffer.check_balanced()["total"] == len(source.prompts)
    # chunks smaller than the batch: keep submitting until the target is met
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "1")
    source, buffer, outs = run_steps(env, args, 1)
    assert len(outs[0].groups) == 3 and all(len(c) == 1 for c in source.calls)


def test_filter_rejects_are_dropped_with_reason_and_reward_failures_counted(env):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "4",
                     "--dynamic-sampling-filter-path", "rollout_env.only_even_groups",
                     "--rm-type", "math", "--custom-rm-path", "rollout_env.failing_rm")
    source, buffer, outs = run_steps(env, args, 2)
    for out in outs:
        assert all(g[0].group_index % 2 == 0 for g in out.groups) and len(out.groups) == 3
        failed = [s for g in out.groups for s in g if s.status == Status.FAILED]
        assert out.metrics["rollout/failed_samples"] == len(failed)
        assert all(s.index % 3 == 0 and "judge unavailable" in s.metadata["failure"] for s in failed)
    assert sum(o.metrics["rollout/failed_samples"] for o in outs) > 0
    s = buffer.check_balanced()
    assert s["dropped/odd group"] == sum(o.metrics.get("rollout/groups_dropped/odd group", 0) for o in outs) > 0


def test_slow_reward_does_not_block_the_drain(env, monkeypatch):
    import slime.rollout.step as step

    rollout_env.SLOW_GATE = gate = SlowRewardGate()
    drain = step.stop_and_drain

    async def drain_then_release_the_slow_rewards(state, io, *rest):
        await drain(state, io, *rest)
        gate.drained.set()

    monkeypatch.setattr(step, "stop_and_drain", drain_then_release_the_slow_rewards)
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "8", "--rollout-batch-size", "2",
                     "--rm-type", "math", "--custom-rm-path", "rollout_env.slow_rm")
    source, buffer, outs = run_steps(env, args, 1, source=SlowFirstSource(args, env["tok"]), train=False)
    with gate.lock:
        slow_done_at_return, gave_up = list(gate.slow_done), list(gate.gave_up)
    m = outs[0].metrics
    assert gate.fast_groups_done.is_set()
    assert all(g[0].group_index not in (0, 1) for g in outs[0].groups) and len(outs[0].groups) == 2
    # the step stopped and drained while groups 0/1 were still rewarding (their rewards could end only after it) ...
    assert gave_up == [], f"the drain waited for the slow rewards: {gave_up} gave up waiting for it"
    # ... and their rewards were awaited before the step returned
    assert len(slow_done_at_return) == 2 * args.n_samples_per_prompt, slow_done_at_return
    ready = buffer.take_ready(10)  # finished after the target: kept for the next step, rewarded
    assert all(s.reward == 0.5 for g in ready for s in g) and m["rollout/groups_ready_out"] == len(ready)
    assert {0, 1} <= {g[0].group_index for g in ready}  # they finished generating first: never parked, never lost
    assert all(buffer.group_state(gid) == FINISHED for gid in (0, 1))


@pytest.mark.parametrize("policy", ["restart", "mask", "keep", "guarded"])
def test_staleness_policies(env, policy):
    """(guarded: `restart` with the length guard on: what it would restart is masked, and counted as the guard's)"""
    guarded = policy == "guarded"
    flags = ["--staleness-policy", "restart"] if guarded else \
        ["--staleness-policy", policy, *(["--disable-length-guard"] if policy == "restart" else [])]
    policy = "mask" if guarded else policy
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "8", "--max-staleness", "1",
                     *flags, "--rollout-max-response-len", "96").replace(rollout_ignore_eos=True)
    source, buffer, outs = run_steps(env, args, 1, source=LongFirstSource(args, env["tok"]))
    for _ in range(3):  # (the long groups make a partial one all but certain) step on until one was parked
        if any(not s.status.is_finished and s.response_length for g in buffer._parked for s in g):
            break
        run_steps(env, args, 1, source=source, buffer=buffer)
    stale = [s for g in buffer._parked for s in g if not s.status.is_finished and s.response_length]
    assert stale, "nothing partial was parked"
    # every parked group is resumed below: its unfinished samples and its finished ones alike are checked
    parked_groups = {g[0].group_index for g in buffer._parked}
    # jump two versions: tokens from version 0 are now older than current (2) - max_staleness (1). The step takes
    # every parked group in its first chunk (APRIL's top-ups may have parked more than 8), so each one is checked
    # groups held ready from the top-ups count first toward the target: ask for 3 more than those, so that the step
    # must supply (parked first) rather than return the ready ones alone
    args2 = args.replace(rollout_batch_size=buffer.num_ready() + 3, over_sampling_batch_size=buffer.num_parked() + 8)
    _, _, outs2 = run_steps(env, args2, 1, source=source, buffer=buffer, first_version=2, train=False)
    m = outs2[0].metrics
    assert m["rollout/groups_resumed"] >= len({s.group_index for s in stale})
    assert m[f"rollout/staleness_{policy}"] >= len(stale) and m["rollout/staleness_stale_groups"] > 0
    others = {"restart", "mask", "keep"} - {policy}
    assert all(m[f"rollout/staleness_{o}"] == 0 for o in others)
    resumed = [s for g in outs2[0].groups + buffer._parked + buffer._ready for s in g if s.group_index in parked_groups]
    old = [(v, k) for s in resumed for v, k in zip(s.weight_versions, s.loss_mask) if v == 0]
    if policy == "restart":
        assert old == [] and m["rollout/staleness_restarted_tokens"] > 0
    elif policy == "mask":
        assert old and all(k == 0 for _, k in old) and m["rollout/staleness_masked_tokens"] == len(old)
        assert m["rollout/staleness_guard_masked"] == (m["rollout/staleness_mask"] if guarded else 0)
    else:
        assert old and all(k == 1 for _, k in old)


def test_evaluation_generates_given_groups_without_buffer(env):
    args = make_args(env["root"], "--eval-temperature", "0", "--eval-max-response-len", "12")
    source = RolloutDataSource(args, env["tok"])
    groups = source.get_groups(3)
    ctx = engine_rollout(args, None, None, env["engines"]).context(eval_groups=groups)
    out = generate_rollout(args, 0, ctx, evaluation=True)
    assert out.groups == groups and all(s.status.is_finished and s.response_length <= 12 for g in groups for s in g)
    # greedy: both samples of a prompt give the same answer
    assert all(g[0].response_tokens == g[1].response_tokens for g in groups)
    assert out.metrics["eval/eval/samples"] == 6 and "eval/eval/reward_mean" in out.metrics


def test_custom_generate_function_contract(env):
    args = make_args(env["root"], "--custom-generate-function-path", "tests.plugins_for_tests.tool_turn_generate")
    source, buffer, outs = run_steps(env, args, 1, first_version=0)
    groups = outs[0].groups
    assert len(groups) == 3
    for g in groups:
        for s in g:
            assert s.status is Status.COMPLETED
            assert s.loss_mask.count(0) == 1  # the inserted tool token, out of the loss
            assert len(s.loss_mask) == len(s.rollout_log_probs) == len(s.weight_versions) == s.response_length
            assert s.response_length <= args.rollout_max_response_len
            model_positions = [i for i, m in enumerate(s.loss_mask) if m]
            tf = teacher_forced(env["model"], s)
            assert max(abs(tf[i] - s.rollout_log_probs[i]) for i in model_positions) < 1e-4


def test_custom_generate_function_must_return_the_sample(env):
    args = make_args(env["root"], "--custom-generate-function-path", "tests.plugins_for_tests.returns_nothing_generate")
    with pytest.raises(Exception, match="--custom-generate-function-path .*returns_nothing_generate: must return the Sample"):
        run_steps(env, args, 1)


def test_a_shared_http_session_is_reused_across_steps_and_left_open(env, tmp_path):
    """Every step sends through the caller's session (keep-alive reused) and never closes it."""
    import aiohttp

    args = make_args(env["root"], "--partial-rollout", "--rollout-mode", "pool", "--rollout-pool-size", "6",
                     "--run-dir", str(tmp_path))
    source, buffer = RecordingSource(args, env["tok"]), PartialRolloutBuffer(args)

    async def main():
        requests_sent = []
        trace = aiohttp.TraceConfig()

        async def on_start(session, ctx, params):
            requests_sent.append((params.method, str(params.url)))

        trace.on_request_start.append(on_start)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64), trace_configs=[trace]) as session:
            rollout = engine_rollout(args, buffer, source, env["engines"])
            rollout.link.session = session
            outs = []
            for step in range(3):
                set_version(env, step)
                rollout.version = step
                outs.append(await rollout.step(step))
                buffer.mark([g[0].group_index for g in outs[-1].groups], TRAINED)
                assert not session.closed
            return outs, requests_sent

    outs, sent = asyncio.run(main())
    assert all(len(o.groups) == 3 for o in outs)
    generates = [u for m, u in sent if u.endswith("/generate")]
    aborts = [u for m, u in sent if u.endswith("/abort_request")]
    assert len(generates) >= sum(o.metrics["rollout/requests"] for o in outs)  # every request went through it
    # each step with requests in flight at its stop sent its abort fan-out through it as well (a step met by the
    # groups held ready from the last one submits nothing and aborts nothing; the first step always has some)
    trace = [json.loads(line) for line in open(tmp_path / "rollout_trace.jsonl")]
    aborting = sum(t["abort"]["in_flight"] > 0 for t in trace)
    assert len(trace) == 3 and aborting >= 1 and len(aborts) >= aborting
    buffer.check_balanced()


def test_trace_records_the_workload_for_the_simulator(env, tmp_path):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "6", "--run-dir", str(tmp_path))
    _, _, outs = run_steps(env, args, 2)
    trace = [json.loads(line) for line in open(tmp_path / "rollout_trace.jsonl")]
    recorded = [sorted(g) for tr in trace for g in tr["finished_lengths"]]
    for out, tr in zip(outs, trace):
        assert tr["target"] == 3 and tr["n_samples_per_prompt"] == 2 and tr["over_sampling_batch_size"] == 6
        assert tr["num_engines"] == 1 and tr["in_flight_cap"] == 6 and tr["max_response_len"] == 24
        # every accepted group's final lengths were recorded (in the step it finished), and the unfinished
        # samples' current lengths
        for g in out.groups:
            assert sorted(s.response_length for s in g) in recorded
        assert len(recorded) >= 6
        assert all(0 <= x < 24 for x in tr["unfinished_lengths"])
        occ = tr["occupancy"]
        if out.metrics["rollout/requests"]:  # (a step whose target the ready groups met sends nothing)
            assert max(n for _, n in occ) <= 6 and occ[-1][1] == 0
            assert 0 <= tr["first_request_t"] <= tr["drained_t"] <= tr["step_time_s"]
        assert out.metrics["rollout/over_sampling_batch_size"] == 6


def test_over_sampling_auto_sizes_every_step_and_logs_it(env, tmp_path):
    from slime.rollout.simulator.planner import OverSamplingPlanner

    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "auto", "--run-dir", str(tmp_path))
    planner = OverSamplingPlanner.from_args(args)
    source = RecordingSource(args, env["tok"])
    buffer = PartialRolloutBuffer(args)
    with pytest.raises(ValueError, match="needs its planner"):
        engine_rollout(args, buffer, source, env["engines"])
    sizes = []
    for step in range(4):
        set_version(env, step)
        out = generate_rollout(args, step, engine_rollout(args, buffer, source, env["engines"], planner=planner, policy_version=step).context())
        buffer.mark([g[0].group_index for g in out.groups], TRAINED)
        planner.wait(timeout=120)  # plans run in the background; the test takes each one before the next step
        sizes.append(out.metrics["rollout/over_sampling_batch_size"])
        assert len(out.groups) == 3
        if step:  # from the second step on, the size comes from a plan with its prediction
            assert out.metrics["rollout/over_sampling_predicted_tokens_per_s"] > 0
    assert sizes[0] == 6  # 2 x the batch before anything is known
    assert all(s in planner.candidates() for s in sizes)
    assert planner.cost is not None and planner.cost.extra["timed_from"] == "scheduler_stats"  # calibrated once
    assert [h["after_step"] for h in planner.history] == [1, 2, 4]
    buffer.check_balanced()


def test_a_prompt_the_engine_refuses_is_dropped_with_its_reason_not_fatal(env):
    args = make_args(env["root"], "--partial-rollout", "--over-sampling-batch-size", "4")
    source = OverlongSource(args, env["tok"])
    source, buffer, outs = run_steps(env, args, 1, source=source)
    out = outs[0]
    assert 1 not in [g[0].group_index for g in out.groups] and len(out.groups) == 2  # 1 failed group + 2 accepted
    reason = buffer.ledger.reason(1)
    assert reason.startswith("engine_refused: input_ids: prompt of") and "max positions (256)" in reason
    assert out.dropped[1] == reason and out.metrics["rollout/groups_failed"] == 1
    assert out.metrics["rollout/groups_dropped/engine_refused"] == 1
    assert buffer.check_balanced()["dropped/engine_refused"] == 1


def test_groups_with_no_trainable_sample_count_toward_the_target(env):
    """A reward that fails on every sample."""
    args = make_args(env["root"], "--over-sampling-batch-size", "3", "--custom-rm-path", "rollout_env.always_failing_rm")
    source, buffer, outs = run_steps(env, args, 2, train=False)
    for out in outs:
        assert out.groups == [] and out.metrics["rollout/groups_failed"] == 3
        assert set(out.dropped.values()) == {"reward_failed: ZeroDivisionError: division by zero"}
    assert source.group_counter == 6  # 3 per step: the target, not the whole dataset
    assert buffer.check_balanced()["dropped/reward_failed"] == 6
