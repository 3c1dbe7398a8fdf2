"""The multi-turn generate wired into the rollout's request path."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from slime.arguments import BUILTIN_MULTI_TURN_GENERATE
from slime.backends.sglang_utils import http_client
from slime.rollout.multi_turn import ToolAgent
from slime.rollout.multi_turn.trajectory import KEY
from slime.rollout.rollout_metrics import sample_metrics
from slime.rollout.sampling_request import SampleRequester
from slime.rollout.staleness import StalenessCap
from slime.rollout.version_gate import GatedRequester, VersionGate
from slime.tasks import subtract_tool as task
from slime.utils.types import Sample, Status
from tests.test_multi_turn import COUNTING, ScriptedModel, fresh_sample, runner, script, tok  # noqa: F401

URL = "http://127.0.0.1:1"


def sglang_reply(seg, version) -> dict:
    """The scripted policy's segment as SGLang's /generate reply."""
    return {"text": seg.text, "output_ids": list(seg.ids),
            "meta_info": {"id": "rid", "finish_reason": {"type": seg.finish}, "weight_version": str(version),
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(seg.log_probs, seg.ids)]}}


class ScriptedEngine:
    """`http_client.generate` answered by a scripted policy."""

    def __init__(self, model: ScriptedModel, gate: VersionGate | None = None):
        self.model, self.gate = model, gate
        self.payloads: list[dict] = []
        self.in_flight_seen: list[int] = []
        self.hold: asyncio.Event | None = None  # when set: each request waits for it (an abort-all ends it)

    async def generate(self, session, url, payload, timeout=None):
        self.payloads.append(payload)
        if self.gate is not None:
            self.in_flight_seen.append(self.gate.in_flight)
        seg = await self.model(SimpleNamespace(tokens=payload["input_ids"]), payload["sampling_params"])
        return sglang_reply(seg, self.model.version)


@pytest.fixture
def args(base_args):
    return base_args.replace(agent_env="slime.tasks.subtract_tool.ENV", custom_generate_function_path=BUILTIN_MULTI_TURN_GENERATE,
                             rollout_max_response_len=256, max_turns=64)


def requester(args, agent, policy_version=0):
    return SampleRequester(args, None, URL, {"temperature": 1.0}, rollout_id=3, policy_version=policy_version,
                           agent=agent)


def test_each_model_turn_is_one_request_of_the_step(args, tok, script, runner, monkeypatch):  # noqa: F811
    """Through `SampleRequester.generate` (the step's per-sample call)."""
    target, obs = script
    engine = ScriptedEngine(ScriptedModel(tok, 6, target, obs))
    monkeypatch.setattr(http_client, "generate", engine.generate)
    req = requester(args, ToolAgent(COUNTING, tok, runner, max_turns=64))
    s = fresh_sample(tok)
    assert asyncio.run(req.generate(s, asyncio.Event())) is True
    assert s.status is Status.COMPLETED and s.response_tokens == target
    turns = [t for t in s.metadata[KEY]["turns"] if t["kind"] == "model"]
    assert req.requests == len(engine.payloads) == len(turns) >= 3
    assert all(p["rid"].startswith("r3-g0-s0-") and p["return_logprob"] for p in engine.payloads)
    assert [len(p["input_ids"]) for p in engine.payloads] == [6 + t["start"] for t in turns]
    assert req.new_tokens == sum(s.loss_mask) == sum(t["end"] - t["start"] for t in turns)
    assert req.in_flight == 0 and req.peak_in_flight == 1
    assert s.weight_versions == [0] * s.response_length


def test_a_resumed_sample_keeps_its_whole_budget(args, tok, script, runner, monkeypatch):  # noqa: F811
    """max_new_tokens is the whole response budget (upstream's convention)."""
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    monkeypatch.setattr(http_client, "generate", ScriptedEngine(model).generate)
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    cut = args.replace(rollout_max_response_len=12)
    whole = fresh_sample(tok)
    asyncio.run(requester(cut, agent).generate(whole))
    model.abort_at = 4
    parked = fresh_sample(tok, 1)
    asyncio.run(requester(cut, agent).run_custom(parked))  # no stop: an engine abort ends the call ABORTED
    assert parked.status is Status.ABORTED and parked.response_length == 4
    parked = Sample.from_dict(parked.to_dict())
    asyncio.run(requester(cut, agent).generate(parked))
    assert whole.status is parked.status is Status.TRUNCATED
    assert parked.response_length == whole.response_length == 12 and parked.tokens == whole.tokens


def test_without_the_managers_agent_the_generate_refuses(args, tok, monkeypatch):
    s = fresh_sample(tok)
    with pytest.raises(RuntimeError, match="no agent_scope is active"):
        asyncio.run(requester(args, None).generate(s))


def test_a_refused_turn_fails_only_its_sample(args, tok, runner, monkeypatch):  # noqa: F811
    async def refuse(session, url, payload, timeout=None):
        raise http_client.EngineHTTPError("POST", url + "/generate", 400, "prompt too long")

    monkeypatch.setattr(http_client, "generate", refuse)
    req = requester(args, ToolAgent(COUNTING, tok, runner, max_turns=4))
    s = fresh_sample(tok)
    assert asyncio.run(req.generate(s)) is True
    assert s.status is Status.FAILED and s.metadata["failure"] == "engine_refused: prompt too long"
    assert req.refused == 1


# ---- through train_async.py's version gate ---------------------------------------------------------------
def gated(args, tok, runner, model, cap=StalenessCap(), version=0):  # noqa: F811
    gate = VersionGate(version)
    engine = ScriptedEngine(model, gate)
    req = requester(args, ToolAgent(COUNTING, tok, runner, max_turns=64), policy_version=version)
    return gate, engine, GatedRequester(req, gate, cap)


def test_gated_turns_are_counted_in_flight_and_tagged_in_their_window(args, tok, script, runner, monkeypatch,  # noqa: F811
                                                                      caplog):
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    gate, engine, g = gated(args, tok, runner, model)
    monkeypatch.setattr(http_client, "generate", engine.generate)
    s = fresh_sample(tok)
    assert asyncio.run(g.generate(s, asyncio.Event())) is True
    assert s.status is Status.COMPLETED and s.response_tokens == target
    assert engine.in_flight_seen and all(n == 1 for n in engine.in_flight_seen)  # a hold drains them
    assert gate.in_flight == 0
    # a reply from a version the engines never served while the request ran: a warning naming the request, counted
    # on the sample, its tokens labelled with the newest version our record allows (never newer than the truth)
    model.version = 5
    s1 = fresh_sample(tok, 1)
    with caplog.at_level(logging.WARNING, "slime.rollout.engine_versions"):
        assert asyncio.run(g.generate(s1, asyncio.Event())) is True
    assert set(s1.weight_versions) == {0} and s1.metadata["version_disagreements"] >= 1
    assert any("versions [5]" in r.message and "-g" in r.message for r in caplog.records)


def test_a_held_gate_parks_the_turn_and_a_new_version_applies_the_cap(args, tok, script, runner, monkeypatch):  # noqa: F811
    """The gate held between two turns (a weight update)."""
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    gate, engine, g = gated(args, tok, runner, model, cap=StalenessCap(0, "restart"))
    monkeypatch.setattr(http_client, "generate", engine.generate)

    async def main():
        s = fresh_sample(tok)
        model.stop_after_call, model.stop = 1, asyncio.Event()  # the first call's reply "holds" the gate
        task_ = asyncio.ensure_future(g.generate(s, asyncio.Event()))
        await model.stop.wait()
        await gate.hold("update", engines=None)  # nothing in flight once the reply is back: no abort needed
        sent = len(engine.payloads)
        await asyncio.sleep(0.3)  # the tool answered meanwhile; the next turn waits at the gate
        assert len(engine.payloads) == sent and not task_.done()
        assert s.metadata[KEY]["calls"][0]["state"] in ("pending", "done")
        gate.set_version(1)
        gate.set_train_version(1)
        model.version = 1
        gate.release("update")
        assert await task_ is True
        return s

    s = asyncio.run(main())
    assert s.status is Status.COMPLETED and s.response_tokens == target
    assert gate.staleness["restart"] == 1 and s.metadata["staleness_restarts"] == 1
    assert set(s.weight_versions) == {1}  # written again at the new version, observations included


def test_a_step_stopping_while_the_gate_is_held_parks_the_sample(args, tok, script, runner, monkeypatch):  # noqa: F811
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    gate, engine, g = gated(args, tok, runner, model)
    monkeypatch.setattr(http_client, "generate", engine.generate)

    async def main():
        stop = asyncio.Event()
        s = fresh_sample(tok)
        model.stop_after_call, model.stop = 1, asyncio.Event()
        task_ = asyncio.ensure_future(g.generate(s, stop))
        await model.stop.wait()
        await gate.hold("update", engines=None)
        await asyncio.sleep(0.2)
        stop.set()
        return s, await asyncio.wait_for(task_, 10)

    s, done = asyncio.run(main())
    assert done is False and s.status is Status.ABORTED
    calls = s.metadata[KEY]["calls"]
    assert len(calls) == 1 and calls[0]["state"] in ("pending", "done")  # parked, the call kept (never re-run)


def test_batch_metrics_carry_the_tool_metrics_of_multi_turn_samples(args, tok, script, runner, monkeypatch):  # noqa: F811
    target, obs = script
    monkeypatch.setattr(http_client, "generate", ScriptedEngine(ScriptedModel(tok, 6, target, obs)).generate)
    req = requester(args, ToolAgent(COUNTING, tok, runner, max_turns=64))
    group = [fresh_sample(tok, i) for i in range(2)]
    for s in group:
        asyncio.run(req.generate(s))
        s.reward = 1.0
    m = sample_metrics([group])
    calls = len(group[0].metadata[KEY]["calls"])
    assert m["rollout/tool/calls_per_sample_mean"] == calls and m["rollout/tool/samples"] == 2.0
    assert m["rollout/tool/call_rate"] == calls / (calls + 1)  # every turn but the answer ends in a call
    single = Sample(index=9, group_index=9, tokens=[1, 2], status=Status.COMPLETED, reward=0.0)
    assert not any("tool" in k for k in sample_metrics([[single]]))
    assert task.ENV.tool("calculator") is not None


def test_the_staleness_cap_reads_model_tokens_only(args, tok, script, runner, monkeypatch):  # noqa: F811
    """A trajectory written across versions 0 and 2 (parked after its first call, resumed after two updates)."""
    target, obs = script
    model = ScriptedModel(tok, 6, target, obs)
    monkeypatch.setattr(http_client, "generate", ScriptedEngine(model).generate)
    agent = ToolAgent(COUNTING, tok, runner, max_turns=64)
    s = fresh_sample(tok)
    model.abort_at = len(target) // 2
    asyncio.run(requester(args, agent).generate(s))
    assert s.status is Status.ABORTED
    model.version = 2
    asyncio.run(requester(args, agent, policy_version=2).generate(s))
    assert s.status is Status.COMPLETED and set(s.weight_versions) == {0, 2}
    model_mask = [1 - o for o in obs]
    assert s.loss_mask == model_mask
    old_model = sum(1 for v, m in zip(s.weight_versions, model_mask) if m and v < 1)
    assert 0 < s.loss_tokens_older_than(1) == old_model
    kept, stale, counts = StalenessCap(1, "mask").before_training([[s]], train_version=2)
    assert kept == [[s]] and counts["masked_tokens_at_train"] == old_model
    assert all(m == 0 for m, o in zip(s.loss_mask, obs) if o)
    assert [m for m, v in zip(s.loss_mask, s.weight_versions) if v == 2] == [1 - o for o, v in
                                                                               zip(obs, s.weight_versions) if v == 2]
