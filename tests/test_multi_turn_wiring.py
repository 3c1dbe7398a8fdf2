"""The multi-turn generate wired into the rollout's request path (slime/rollout/sampling_request.py and
train_async.py's version gate, slime/rollout/version_gate.py).

The requester and the gate are the real ones; only the engine's reply comes from a deterministic scripted
policy (tests/test_multi_turn.py's ScriptedModel) in SGLang's /generate reply shape, so that the tests are
fast and exact. The same wiring against the embedded engine and sglang-router, driven by train.py and
train_async.py, is tests/test_multi_turn_e2e.py (slow). Also here: the multi-turn flags, the trainer's loss on
multi-turn samples (observation tokens carry no gradient) and the run summary's tool lines.
"""

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
from tests.test_multi_turn import COUNTING, ScriptedModel, fresh_sample, run, runner, script, tok  # noqa: F401

URL = "http://127.0.0.1:1"


def sglang_reply(seg, version) -> dict:
    """The scripted policy's segment as SGLang's /generate reply."""
    return {"text": seg.text, "output_ids": list(seg.ids),
            "meta_info": {"id": "rid", "finish_reason": {"type": seg.finish}, "weight_version": str(version),
                          "output_token_logprobs": [[lp, t, None] for lp, t in zip(seg.log_probs, seg.ids)]}}


class ScriptedEngine:
    """`http_client.generate` answered by a scripted policy; records each payload and the gate's in-flight count
    while the request runs."""

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
    """Through `SampleRequester.generate` (the step's per-sample call): every model turn is one /generate with
    the sample's token ids and a rid of the step; the counters see model tokens only, nothing stays in flight."""
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
    """max_new_tokens is the whole response budget (upstream's convention): a sample parked mid-turn and resumed
    by a fresh requester stops at the same total length as one that was never parked."""
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
    """The gate held between two turns (a weight update): the next turn waits at the gate, unsent; when the
    gate reopens at a new version the sample goes back through the staleness cap first (restart, lag 0: its
    stale trajectory is dropped and written again at the new version), then runs to the same trajectory."""
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
    """A trajectory written across versions 0 and 2 (parked after its first call, resumed after two updates):
    the cap at training (lag 1, mask) masks its version-0 model tokens; observation tokens were never in the
    loss and stay out, so what the cap counts and masks are model tokens."""
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


# ---- the flags --------------------------------------------------------------------------------------------------
def test_agent_flags_are_filled_with_agent_env_and_refused_without(base_args):
    from slime.arguments import ArgumentError, parse_args

    base = ["--hf-checkpoint", base_args.hf_checkpoint, "--prompt-data", base_args.prompt_data, "--rm-type", "math",
            "--rollout-batch-size", "1", "--num-rollout", "1", "--run-dir", base_args.run_dir]
    a = parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV", "--max-tokens-per-turn", "64"])
    assert a.custom_generate_function_path == "slime.rollout.multi_turn.generate"
    assert (a.max_turns, a.tool_timeout, a.tool_workers, a.max_tokens_per_turn) == (16, 30.0, 4, 64)
    assert base_args.agent_env is None and base_args.max_turns is None and base_args.tool_timeout is None
    with pytest.raises(ArgumentError, match="--max-turns: needs --agent-env"):
        parse_args(base + ["--max-turns", "4"])
    with pytest.raises(ArgumentError, match="--agent-env: runs the built-in multi-turn generate"):
        parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV",
                           "--custom-generate-function-path", "tests.plugins_for_tests.tool_turn_generate"])
    with pytest.raises(ArgumentError, match="--tool-timeout: must be > 0"):
        parse_args(base + ["--agent-env", "slime.tasks.subtract_tool.ENV", "--tool-timeout", "0"])


# ---- training ---------------------------------------------------------------------------------------------------
def test_observation_tokens_never_carry_gradient(tok, script, runner, base_args, tmp_path):
    """The trainer's own loss (policy gradient with TIS, entropy bonus) on multi-turn samples: the log-probs and
    entropies of observation tokens get exactly zero gradient, every model token's log-prob does not."""
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
        old = list(forward_micro_batch(model, mb, 1.0, 64)[0].split(mb.response_sizes))
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


def test_the_run_summary_reports_tool_use(tmp_path, base_args, caplog):
    import json
    import logging

    from slime.utils.summary import log_run_summary, summarize

    rows = [{"step": -1, "eval/accuracy": 0.4, "eval/tiny/tool/call_rate": 0.5, "eval/tiny/tool/calls_per_sample_mean": 1.3}]
    rows += [{"step": i, "reward/mean": 0.5, "rollout/tool/call_rate": 0.5 + 0.05 * i, "rollout/tool/failures": float(i == 2)}
             for i in range(8)]
    rows += [{"step": 7, "eval/accuracy": 0.6, "eval/tiny/tool/call_rate": 0.8, "eval/tiny/tool/calls_per_sample_mean": 3.5}]
    s = summarize(rows)
    assert (s["eval_tool_call_rate_first"], s["eval_tool_call_rate_last"]) == (0.5, 0.8)
    assert s["tool_call_rate_first_quarter"] == pytest.approx(0.525) and s["tool_failures"] == 1.0
    assert "tool_call_rate_first_quarter" not in summarize([r for r in rows if "rollout/tool/call_rate" not in r])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="slime.utils.summary"):
        log_run_summary(str(tmp_path), str(tmp_path / "metrics.jsonl"), base_args)
    assert "tool-call rate, eval (model turns ending in a call): 0.500 -> 0.800" in caplog.text
