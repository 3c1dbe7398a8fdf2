"""The multi-turn generate (slime/rollout/multi_turn/) against a deterministic scripted policy."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from slime.rollout.multi_turn import AgentScope, ToolAgent, agent_scope, generate
from slime.rollout.multi_turn.metrics import tool_metrics
from slime.rollout.multi_turn.model_turn import Segment, TurnRefused
from slime.rollout.multi_turn.trajectory import KEY, Trajectory, TrajectoryError
from slime.tasks import subtract_tool as task
from slime.utils.tiny_model import build_tokenizer
from slime.utils.tool_calls import AgentEnv, ToolSpec
from slime.utils.tool_runner import ToolRunner
from slime.utils.types import Sample, Status

PROMPT = "47-5="


def env_with(function: str, safe: bool = True, timeout_s: float | None = None) -> AgentEnv:
    return AgentEnv(tools=(ToolSpec("calculator", function, safe_to_rerun=safe, timeout_s=timeout_s),),
                    call_format=task.CALL_FORMAT, bad_call_output=task.BAD_CALL)


COUNTING = env_with("tests.tool_plugins.counting_calculator")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(task.VOCAB)


@pytest.fixture(scope="module")
def runner():
    with ToolRunner(workers=2, timeout_s=10) as r:
        yield r


def runs_logged(runner) -> list[str]:
    path = os.path.join(runner.scratch_dir, "calls.log")
    return open(path).read().split() if os.path.exists(path) else []


def target_of(tok, segments) -> tuple[list[int], list[bool]]:
    """The scripted trajectory's response ids (EOS last) and which of them are observations."""
    ids, obs = [], []
    for text, is_obs in segments:
        seg = tok.encode(text, add_special_tokens=False)
        ids += seg
        obs += [is_obs] * len(seg)
    return ids + [tok.eos_token_id], obs + [False]


class ScriptedModel:
    def __init__(self, tok, prompt_len: int, target: list[int], obs: list[bool]):
        self.tok, self.prompt_len, self.target, self.obs = tok, prompt_len, target, obs
        self.version = 0
        self.abort_at: int | None = None  # response position at which the next reply is aborted (once)
        self.stop_after_call: int | None = None  # set `stop` when the reply ending the k-th call turn is sent
        self.stop: asyncio.Event | None = None
        self.calls_seen = 0
        self.requests = 0

    @staticmethod
    def logprob(pos: int) -> float:
        return -0.05 * (pos % 7 + 1)

    async def __call__(self, sample: Sample, sp: dict) -> Segment:
        self.requests += 1
        resp = sample.tokens[self.prompt_len:]
        pos = len(resp)
        ids: list[int] = []
        finish = "length"
        stops = set(sp.get("stop_token_ids", [])) | {self.tok.eos_token_id}
        diverged = resp != self.target[:pos] or (pos < len(self.target) and self.obs[pos])
        while len(ids) < sp["max_new_tokens"]:
            if self.abort_at is not None and pos + len(ids) == self.abort_at:
                self.abort_at = None
                finish = "abort"
                break
            p = pos + len(ids)
            tok = self.tok.eos_token_id if diverged or p >= len(self.target) else self.target[p]
            ids.append(tok)
            if tok in stops:
                finish = "stop"
                break
        if ids and ids[-1] == self.tok.convert_tokens_to_ids("]") and finish == "stop":
            self.calls_seen += 1
            if self.stop_after_call == self.calls_seen:
                self.stop.set()
        return Segment(ids, [self.logprob(pos + k) for k in range(len(ids))], self.version,
                       self.tok.decode(ids), finish)


def fresh_sample(tok, index: int = 0) -> Sample:
    ids = [tok.bos_token_id] + tok.encode(PROMPT, add_special_tokens=False)
    return Sample(index=index, group_index=index, prompt=PROMPT, tokens=ids, label=task.solve(47, 5))


SEGMENTS = task.tool_teacher(PROMPT, random.Random(3), p_call=0.5, p_err=0.2)


@pytest.fixture(scope="module")
def script(tok):
    target, obs = target_of(tok, SEGMENTS)
    assert sum(obs) >= 4 and sum(1 for t, o in SEGMENTS if not o and "[" in t) >= 2  # at least two calls
    return target, obs


def run(agent, sample, model, budget=256, stop=None) -> Sample:
    return asyncio.run(agent.run(sample, {"temperature": 1.0, "max_new_tokens": budget},
                                 model, stop))


def comparable(sample: Sample) -> dict:
    rec = sample.metadata[KEY]
    calls = [{k: c[k] for k in ("name", "arguments", "state", "error", "truncated")} for c in rec["calls"]]
    return {"tokens": sample.tokens, "loss_mask": sample.loss_mask, "log_probs": sample.rollout_log_probs,
            "versions": sample.weight_versions, "response": sample.response, "status": sample.status,
            "turns": rec["turns"], "calls": calls}


@pytest.fixture(scope="module")
def reference(tok, script, runner):
    target, obs = script
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    before = len(runs_logged(runner))
    s = run(agent, fresh_sample(tok), ScriptedModel(tok, 6, target, obs))
    return s, len(runs_logged(runner)) - before


def test_a_trajectory_is_the_script_with_observations_out_of_the_loss(tok, script, reference):
    target, obs = script
    s, runs = reference
    assert s.status is Status.COMPLETED and s.response_tokens == target
    assert s.loss_mask == [0 if o else 1 for o in obs]
    assert all(lp == 0.0 for lp, o in zip(s.rollout_log_probs, obs) if o)
    assert task.compute_reward(s.response, s.label) == task.compute_reward("".join(t for t, _ in SEGMENTS), s.label)
    traj = Trajectory.of(s)
    model_mask = [0] * s.response_length  # the turns' model tokens are exactly the loss-masked ones
    for t in traj.turns:
        if t["kind"] == "model":
            model_mask[t["start"]:t["end"]] = [1] * (t["end"] - t["start"])
    assert model_mask == s.loss_mask
    kinds = [t["kind"] for t in traj.turns]
    assert kinds[0] == "model" and kinds[-1] == "model" and "tool" in kinds
    assert runs == len(traj.calls) == task.count_calls(s.response) and all(c["state"] == "done" for c in traj.calls)
    m = tool_metrics([s], train_version=1)
    assert m["rollout/tool/calls_per_sample_mean"] == runs and m["rollout/tool/turns_per_sample_mean"] == runs + 1
    assert m["rollout/tool/model_off_policy_token_ratio"] == 1.0 and m["rollout/tool/failures"] == 0


def test_an_abort_at_every_token_of_every_turn_resumes_to_the_same_trajectory(tok, script, reference, runner):
    target, obs = script
    ref, runs = reference
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    model_positions = [p for p, o in enumerate(obs) if not o]
    for p in model_positions:
        model = ScriptedModel(tok, 6, target, obs)
        model.abort_at = p
        before = len(runs_logged(runner))
        s = run(agent, fresh_sample(tok), model)
        assert s.status is Status.ABORTED and s.response_length == p, p
        s = Sample.from_dict(s.to_dict())  # parked in the buffer (and maybe a checkpoint) in between
        s = run(agent, s, model)
        assert comparable(s) == comparable(ref), f"abort at response token {p}"
        assert len(runs_logged(runner)) - before == runs, f"abort at {p}: a tool ran again"


@pytest.mark.parametrize("when", ["running", "finished", "lost"])
def test_an_abort_during_every_tool_call_runs_it_once(tok, script, reference, runner, when):
    """Stopped during a tool call: parked with the call pending; on resume its result is taken, or it runs again."""
    target, obs = script
    ref, runs = reference
    parked_pending = 0
    for k in range(1, runs + 1):
        model = ScriptedModel(tok, 6, target, obs)
        model.stop, model.stop_after_call = asyncio.Event(), k
        agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
        before = len(runs_logged(runner))
        stop = model.stop

        async def first_part():  # the Event belongs to this loop
            return await agent.run(fresh_sample(tok), {"max_new_tokens": 256}, model, stop)

        s = asyncio.run(first_part())
        traj = Trajectory.of(s)
        if traj.pending_call() is None:  # the calculator answered before the stop was seen: also fine
            assert s.status is Status.ABORTED
        else:
            assert s.status is Status.ABORTED and traj.turns[-1]["end_reason"] == "call"
        pending = traj.pending_call()
        parked_pending += pending is not None
        ran = False  # a call still queued at the stop is withdrawn (it never ran) and sent again on resume
        if pending is not None and when in ("finished", "lost"):
            old = runner.lookup(pending["id"])
            ran = not old.cancelled() and old.result(timeout=60).ok
        s = Sample.from_dict(s.to_dict())
        if when == "lost" and pending is not None:
            with ToolRunner(workers=1) as fresh:  # the run restarted: this runner never saw the call
                s = run(ToolAgent(COUNTING, tok, fresh, max_turns=64), s, model)
                again = runs_logged(fresh)
            assert again[0] == pending["arguments"]
            assert len(runs_logged(runner)) - before + len(again) == runs + int(ran)
            assert [c["reran"] for c in s.metadata[KEY]["calls"]] == [i == k - 1 for i in range(runs)]
        else:
            s = run(agent, s, model)
            assert len(runs_logged(runner)) - before == runs, f"stop at call {k} ({when}): a tool ran twice"
        assert comparable(s) == comparable(ref), f"stop at call {k} ({when})"
    assert parked_pending >= runs - 1  # (a call may answer before the stop is seen; then it is not pending)


def test_a_lost_call_the_environment_does_not_allow_to_rerun_fails_the_sample(tok, script, runner):
    target, obs = script
    unsafe = env_with("tests.tool_plugins.slow_counting_calculator", safe=False)
    model = ScriptedModel(tok, 6, target, obs)
    model.stop, model.stop_after_call = asyncio.Event(), 1

    async def first_part():
        return await ToolAgent(unsafe, tok, runner, max_turns=64).run(fresh_sample(tok), {"max_new_tokens": 256},
                                                                      model, model.stop)

    s = asyncio.run(first_part())
    assert Trajectory.of(s).pending_call() is not None  # stopped while the (slow) call ran
    with ToolRunner(workers=1) as fresh:
        s = run(ToolAgent(unsafe, tok, fresh, max_turns=64), Sample.from_dict(s.to_dict()), model)
        assert runs_logged(fresh) == []
    assert s.status is Status.FAILED and s.metadata["failure"].startswith("tool: calculator: its result was lost")


def test_versions_follow_the_policy_across_a_resume(tok, script, reference, runner):
    target, obs = script
    ref, _ = reference
    cut = next(p for p in range(len(obs)) if p > 0 and obs[p - 1] and not obs[p]) + 1  # inside the 2nd model turn
    model = ScriptedModel(tok, 6, target, obs)
    model.abort_at = cut
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    s = run(agent, fresh_sample(tok), model)
    model.version = 1
    s = run(agent, s, model)
    assert s.response_tokens == ref.response_tokens
    assert s.weight_versions[:cut] == [0] * cut and set(s.weight_versions[cut:]) == {1}
    for t in s.metadata[KEY]["turns"]:
        if t["kind"] == "tool":  # an observation carries the version of the turn that called
            assert set(s.weight_versions[t["start"]:t["end"]]) == {s.weight_versions[t["start"] - 1]}


def test_budgets_total_per_turn_and_turns(tok, script, reference, runner):
    target, obs = script
    ref, _ = reference
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    for budget in (5, 7, 8, 12):  # cuts inside model turns and inside observations
        s = run(agent, fresh_sample(tok), ScriptedModel(tok, 6, target, obs), budget=budget)
        assert s.status is Status.TRUNCATED and s.response_tokens == target[:budget], budget
    first_turn = next(p for p, o in enumerate(obs) if o)  # tokens of the first model turn
    before = len(runs_logged(runner))
    s = run(agent, fresh_sample(tok), ScriptedModel(tok, 6, target, obs), budget=first_turn)  # no room for the answer
    assert s.status is Status.TRUNCATED and s.metadata[KEY]["calls"] == [] and len(runs_logged(runner)) == before
    assert s.metadata[KEY]["turns"][-1]["end_reason"] == "length"
    per_turn = ToolAgent(COUNTING, tok, runner, max_turns=64, max_tokens_per_turn=first_turn - 1)
    s = run(per_turn, fresh_sample(tok), ScriptedModel(tok, 6, target, obs))
    assert s.status is Status.TRUNCATED and s.response_length == first_turn - 1
    assert s.metadata[KEY]["turns"][-1]["end_reason"] == "length"
    one_turn = ToolAgent(COUNTING, tok, runner, max_turns=1)
    s = run(one_turn, fresh_sample(tok), ScriptedModel(tok, 6, target, obs))
    assert s.status is Status.TRUNCATED and s.metadata[KEY]["calls"] == []  # its call is never run
    assert s.metadata[KEY]["turns"][-1]["end_reason"] == "turn_limit"


def test_a_call_written_badly_gets_the_environments_error_and_goes_on(tok, runner):
    segs = [("42]", False), ("??", True), (",37", False)]
    target, obs = target_of(tok, segs)
    s = run(ToolAgent(COUNTING, tok, runner, max_turns=8), fresh_sample(tok), ScriptedModel(tok, 6, target, obs))
    assert s.status is Status.COMPLETED and s.response_tokens == target
    call = s.metadata[KEY]["calls"][0]
    assert call["state"] == "bad_call" and call["error"] == "']' without '['"
    assert tool_metrics([s])["rollout/tool/bad_calls"] == 1


@pytest.mark.parametrize("function,timeout_s,error", [
    ("tests.tool_plugins.raises", None, "raised ZeroDivisionError: division by zero"),
    ("tests.tool_plugins.hangs", 0.3, "timed out after 0.3s"),
    ("tests.tool_plugins.returns_int", None, "returned int, not str"),
    ("tests.tool_plugins.exits", None, "worker exited with code 3"),
    ("tests.tool_plugins.echo", None, "returned text the tokenizer cannot encode"),
])
def test_a_tool_that_fails_hangs_or_returns_garbage_fails_the_sample_and_names_why(tok, script, function, timeout_s,
                                                                                  error):
    target, obs = script
    with ToolRunner(workers=1, timeout_s=10) as r:
        s = run(ToolAgent(env_with(function, timeout_s=timeout_s), tok, r, max_turns=64), fresh_sample(tok),
                ScriptedModel(tok, 6, target, obs))
    assert s.status is Status.FAILED and s.metadata["failure"].startswith(f"tool: calculator: {error}")
    from slime.utils.ledger import group_failure_reason

    assert group_failure_reason([s]).startswith(f"tool: calculator: {error}")  # the ledger's drop reason
    m = tool_metrics([s])
    assert m["rollout/tool/failures"] == 1 and m["rollout/tool/failures/calculator"] == 1


def test_a_stop_while_a_tool_hangs_parks_the_sample_at_once(tok, script):
    target, obs = script
    with ToolRunner(workers=1, timeout_s=600) as r:
        agent = ToolAgent(env_with("tests.tool_plugins.hangs"), tok, r, max_turns=64)
        model = ScriptedModel(tok, 6, target, obs)

        async def main():
            stop = asyncio.Event()
            task_ = asyncio.ensure_future(agent.run(fresh_sample(tok), {"max_new_tokens": 256}, model, stop))
            while not r.counts["calls"] and not any(not f.done() for f in list(r._calls.values())):
                await asyncio.sleep(0.01)  # until the call is in the runner
            stop.set()
            return await asyncio.wait_for(task_, 30)

        s = asyncio.run(main())
        pending = Trajectory.of(s).pending_call()
        assert s.status is Status.ABORTED and pending is not None and not r.lookup(pending["id"]).done()


def test_a_refused_turn_fails_the_sample(tok, runner):
    async def refuse(sample, sp):
        raise TurnRefused("prompt is too long")

    s = run(ToolAgent(COUNTING, tok, runner, max_turns=4), fresh_sample(tok), refuse)
    assert s.status is Status.FAILED and s.metadata["failure"] == "engine_refused: prompt is too long"


def test_a_record_that_does_not_match_the_response_is_refused_and_a_reset_one_restarts(tok, script, runner):
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    model.abort_at = 9
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    s = run(agent, fresh_sample(tok), model)
    s.append_response([tok.eos_token_id], [0.0], 0)  # grown behind the agent's back
    with pytest.raises(TrajectoryError, match="covers 9 response tokens, the response has 10"):
        run(agent, s, model)
    s.reset_response()  # --staleness-policy restart
    s = run(agent, s, model)
    assert s.status is Status.COMPLETED and s.response_tokens == target


def test_a_staleness_restart_lets_go_of_the_call_it_left_pending(tok, script, runner):
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    model.stop, model.stop_after_call = asyncio.Event(), 1
    agent = ToolAgent(env_with("tests.tool_plugins.slow_counting_calculator"), tok, runner, max_turns=64)
    stop = model.stop

    async def first_part():
        return await agent.run(fresh_sample(tok), {"max_new_tokens": 256}, model, stop)

    s = asyncio.run(first_part())
    pending = Trajectory.of(s).pending_call()
    assert pending is not None and runner.lookup(pending["id"]) is not None
    s.reset_response()  # --staleness-policy restart
    s = run(agent, s, ScriptedModel(tok, 6, target, obs))
    assert s.status is Status.COMPLETED and s.response_tokens == target
    assert runner.lookup(pending["id"]) is None and pending["id"] not in {c["id"] for c in s.metadata[KEY]["calls"]}


def test_upstream_signature_generate_runs_in_the_agent_scope(tok, script, runner):
    target, obs = script
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)

    async def main():
        with agent_scope(AgentScope(agent, ScriptedModel(tok, 6, target, obs))):
            return await generate(None, fresh_sample(tok), {"max_new_tokens": 256})

    assert asyncio.run(main()).response_tokens == target
    with pytest.raises(RuntimeError, match="no agent_scope is active"):
        asyncio.run(generate(None, fresh_sample(tok), {"max_new_tokens": 256}))


def test_the_agent_of_the_flags(tok, base_args):
    agent = ToolAgent.from_args(base_args.replace(agent_env="slime.tasks.subtract_tool.ENV", max_turns=3,
                                                  max_tokens_per_turn=None, tool_workers=1, tool_timeout=5.0,
                                                  tool_max_output_chars=16, tool_memory_mb=0), tok)
    try:
        assert agent.env is task.ENV and agent.max_turns == 3 and agent.runner.timeout_s == 5.0
        assert agent.close_token_id == tok.convert_tokens_to_ids("]")
        assert agent.turn_params({"stop_token_ids": [5]}, 7) == {"stop_token_ids": [5, agent.close_token_id],
                                                                 "max_new_tokens": 7, "no_stop_trim": True}
    finally:
        agent.close()
    with pytest.raises(TypeError, match="--agent-env slime.tasks.subtract_tool.calculator: is a function"):
        ToolAgent.from_args(base_args.replace(agent_env="slime.tasks.subtract_tool.calculator"), tok)
    with pytest.raises(ImportError, match="tool 'ghost' names tests.no_such_module.run, but there is no module"):
        ToolAgent.from_args(base_args.replace(agent_env="tests.tool_plugins.MISSING_TOOL_ENV"), tok)
