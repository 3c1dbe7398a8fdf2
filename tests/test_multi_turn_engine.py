"""The multi-turn generate against the embedded engine behind the real sglang-router."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
import torch

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.rollout.multi_turn import ToolAgent
from slime.rollout.multi_turn.trajectory import KEY
from slime.rollout.sampling_request import SampleRequester
from slime.tasks import subtract_tool as task
from slime.tasks.tool_warm_start import ToolWarmStartConfig, teacher_batches
from slime.tasks.warm_start import encode_example, train_warm_start
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer
from slime.utils.tool_runner import ToolRunner
from slime.utils.types import Sample, Status

from logprob_reference import teacher_forced

pytestmark = pytest.mark.slow
SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=128, max_position_embeddings=320)
PROMPTS = ["47-5=", "09-3=", "61-7=", "30-4=", "88-9=", "25-2="]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("multi_turn_engine")
    tok = build_tokenizer(task.VOCAB)
    model = build_tiny_qwen3(str(root / "init"), tok, SPEC, seed=0)
    cfg = ToolWarmStartConfig(batch_size=32, max_steps=120, pool_batches=2, p_call=0.6, lr=3e-3)
    train_warm_start(model, tok, cfg, batches=teacher_batches(cfg, tok, random.Random(0)))
    model.save_pretrained(str(root / "model"))
    tok.save_pretrained(str(root / "model"))
    (root / "prompts.jsonl").write_text('{"prompt": "47-5=", "label": "42"}\n')
    args = parse_args(["--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "prompts.jsonl"),
                       "--custom-rm-path", "slime.tasks.subtract_tool.reward", "--rollout-batch-size", "1",
                       "--num-rollout", "1", "--rollout-backend", "embedded", "--run-dir", str(root / "run"),
                       "--agent-env", "slime.tasks.subtract_tool.ENV"])
    engines = EngineGroup(args, log_dir=str(root / "logs")).start()
    runner = ToolRunner(workers=2, timeout_s=10)
    yield {"tok": tok, "model": model.eval(), "engines": engines, "runner": runner, "args": args}
    runner.close()
    engines.shutdown()


def new_sample(tok, prompt: str, index: int) -> Sample:
    ids = encode_example(tok, prompt, None)[0]
    return Sample(index=index, group_index=index, prompt=prompt, tokens=ids, label=task.solve(*task.parse_prompt(prompt)))


def check_trajectory(env, s: Sample) -> int:
    """Invariants of a finished multi-turn sample; returns how many calls it made."""
    tok, model = env["tok"], env["model"]
    assert s.status in (Status.COMPLETED, Status.TRUNCATED), (s.status, s.metadata.get("failure"))
    s.check()
    rec = s.metadata[KEY]
    expect = teacher_forced(model, s)
    for t in rec["turns"]:
        span = range(t["start"], t["end"])
        if t["kind"] == "model":
            assert all(s.loss_mask[i] == 1 for i in span)
            assert max(abs(s.rollout_log_probs[i] - expect[i]) for i in span) < 2e-3
        else:
            call = rec["calls"][t["call"]]
            assert all(s.loss_mask[i] == 0 and s.rollout_log_probs[i] == 0.0 for i in span)
            shown = tok.decode(s.response_tokens[t["start"]:t["end"]])
            answer = task.calculator(call["arguments"]) if call["state"] == "done" else task.BAD_CALL
            assert call["state"] in ("done", "bad_call") and shown
            if t is rec["turns"][-1] and s.status is Status.TRUNCATED:
                assert answer.startswith(shown)  # cut at the response budget
            else:
                assert shown == answer
    return len(rec["calls"])


async def run_all(env, samples, sp, stop=None, abort_after=None):
    agent = ToolAgent(task.ENV, env["tok"], env["runner"], max_turns=32)
    async with aiohttp.ClientSession() as session:
        model = SampleRequester(env["args"], session, env["engines"].router_url, {}, 0, 0).turn
        jobs = [asyncio.ensure_future(agent.run(s, dict(sp, max_new_tokens=200), model, stop))
                for s in samples]
        if abort_after is not None:
            await asyncio.sleep(abort_after)
            stop.set()
            await env["engines"].abort_all_until_idle(timeout=30, session=session)
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)


def test_trajectories_through_the_engines(env):
    samples = [new_sample(env["tok"], p, i) for i, p in enumerate(PROMPTS * 4)]
    asyncio.run(run_all(env, samples, {"temperature": 1.0, "top_p": 1.0, "skip_special_tokens": False}))
    calls = sum(check_trajectory(env, s) for s in samples)
    assert calls > 0  # the warm start taught it to call


@pytest.mark.parametrize("abort_after", [0.02, 0.1, 0.3])
def test_an_abort_all_mid_trajectory_parks_and_resumes(env, abort_after):
    tok = env["tok"]
    sp = {"temperature": 1.0, "skip_special_tokens": False}
    samples = [new_sample(tok, p, i) for i, p in enumerate(PROMPTS * 4)]
    asyncio.run(run_all(env, samples, sp, stop=asyncio.Event(), abort_after=abort_after))
    parked = [s for s in samples if s.status is Status.ABORTED]
    samples = [Sample.from_dict(s.to_dict()) if s.status is Status.ABORTED else s for s in samples]
    asyncio.run(run_all(env, [s for s in samples if s.status is Status.ABORTED], sp))
    for s in samples:
        check_trajectory(env, s)
    assert parked or abort_after > 0.1  # an early abort catches trajectories in flight


def test_greedy_trajectories_are_the_same_with_and_without_an_abort(env):
    tok = env["tok"]
    sp = {"temperature": 0.0, "skip_special_tokens": False}
    plain = [new_sample(tok, p, i) for i, p in enumerate(PROMPTS)]
    asyncio.run(run_all(env, plain, sp))
    assert sum(len(s.metadata[KEY]["calls"]) for s in plain) >= len(PROMPTS)
    mid_turn = pending = 0
    # where an abort finds a trajectory is timing (a loaded box shifts it): more delays until both places were seen
    for delay in (0.01, 0.05, 0.15, 0.005, 0.02, 0.03, 0.08, 0.1, 0.2, 0.3):
        if mid_turn and pending:
            break
        again = [new_sample(tok, p, i) for i, p in enumerate(PROMPTS)]
        asyncio.run(run_all(env, again, sp, stop=asyncio.Event(), abort_after=delay))
        for s in again:
            if s.status is Status.ABORTED:
                calls = s.metadata[KEY]["calls"]
                pending += bool(calls) and calls[-1]["state"] == "pending"
                mid_turn += not (calls and calls[-1]["state"] == "pending")
        again = [Sample.from_dict(s.to_dict()) for s in again]
        asyncio.run(run_all(env, [s for s in again if s.status is Status.ABORTED], sp))
        for a, b in zip(plain, again):
            assert b.tokens == a.tokens and b.loss_mask == a.loss_mask, f"abort after {delay}s, sample {a.index}"
            assert [t["kind"] for t in b.metadata[KEY]["turns"]] == [t["kind"] for t in a.metadata[KEY]["turns"]]
    assert mid_turn and pending  # parked both mid-turn and with a call running
