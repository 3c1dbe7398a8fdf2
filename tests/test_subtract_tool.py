"""The tiny agentic task: calculator, reward, teacher, warm-start examples and the in-process tool sampler."""

from __future__ import annotations

import random

import pytest
import torch

from slime.tasks import subtract_tool as task
from slime.tasks.tool_warm_start import (ToolWarmStartConfig, encode_trajectory, evaluate_with_tools, sample_with_tools,
                                         teacher_batches)
from slime.tasks.warm_start import collate, encode_example, train_warm_start
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(task.VOCAB)


def test_calculator_answers_two_digits_or_question_marks():
    assert [task.calculator(a) for a in ("37-5", "05-5", "7-2", "03-5", "3a-5", "37-51", "", None, 37)] == \
        ["32", "00", "05", "??", "??", "??", "??", "??", "??"]


def test_reward_reads_the_chain_with_calls_removed():
    label = task.solve(47, 5)
    assert task.compute_reward("[47-5]42,37,[37-5]32,27,22,17,12,07,02<eos>", label) == 1.0
    assert task.compute_reward("42,37,32,27,22,17,12,07,02", label) == 1.0
    assert task.compute_reward("[47-5]??,37,32,27,22,17,12,07,02", label) == 0.0
    assert task.compute_reward("[47-5]42,37", label) == 0.0
    assert task.count_calls("[47-5]42,37,[37-5]32") == 2 and task.count_steps("[47-5]42,37,[37-5]32") == 3


def test_the_teacher_is_exact_with_the_tool_and_noisy_without():
    rng = random.Random(0)
    for _ in range(200):
        prompt, label = task.chain.make_problem(rng, cap=24)
        exact = task.tool_teacher(prompt, rng, p_call=1.0, p_err=1.0)
        text = "".join(t for t, _ in exact)
        assert task.compute_reward(text, label) == 1.0 and task.count_calls(text) == task.count_steps(text)
        plain = "".join(t for t, _ in task.tool_teacher(prompt, rng, p_call=0.0, p_err=0.0))
        assert plain == label
    noisy = [task.compute_reward("".join(t for t, _ in task.tool_teacher(p, rng, 0.0, 0.3)), a)
             for p, a in (task.chain.make_problem(rng, cap=24) for _ in range(300))]
    assert 0.2 < sum(noisy) / len(noisy) < 0.8


def test_observations_are_out_of_the_warm_start_loss(tok):
    segments = [("[47-5]", False), ("42", True), (",37", False)]
    ids, n_prompt, mask = encode_trajectory(tok, "47-5=", segments)
    assert tok.decode(ids[n_prompt:]) == "[47-5]42,37<eos>"
    assert mask == [1] * 6 + [0, 0] + [1] * 4
    _, _, labels = collate([(ids, n_prompt, mask), encode_example(tok, "09-3=", "06,03,00")], tok.pad_token_id)
    resp = labels[0, n_prompt:len(ids)]
    assert (resp[6:8] == -100).all() and (resp[:6] != -100).all() and (resp[8:] != -100).all()
    assert (labels[1, 6:14] != -100).all()  # two-element examples keep every response token


def test_tool_sampler_feeds_the_calculators_answer_after_each_call(tok, tmp_path):
    torch.set_num_threads(1)
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64)
    model = build_tiny_qwen3(str(tmp_path / "m"), tok, spec, seed=1).eval()
    cfg = ToolWarmStartConfig(batch_size=16, max_steps=30, pool_batches=2, p_call=0.7)
    train_warm_start(model, tok, cfg, batches=teacher_batches(cfg, tok, random.Random(0)))  # calls, some of them
    prompts = [encode_example(tok, p, None)[0] for p in ("47-5=", "09-3=", "99-1=", "30-4=")] * 8
    res = sample_with_tools(model, tok, prompts, 40, 1.0, torch.Generator().manual_seed(0))
    close = tok.convert_tokens_to_ids("]")
    assert sum(res.calls) > 0
    for ids, obs, calls in zip(res.token_ids, res.observation, res.calls):
        assert len(ids) == len(obs) <= 40 and sum(1 for t, o in zip(ids, obs) if t == close and not o) == calls
        for k, (t, o) in enumerate(zip(ids, obs)):
            if t == close and not o and k + 2 < len(ids):  # the next two tokens are the calculator's answer
                text = tok.decode(ids[:k + 1])
                assert obs[k + 1] and obs[k + 2]
                assert tok.decode(ids[k + 1:k + 3]) == task.calculator(task.ENV.parse_call(text).arguments)
    rows = [{"prompt": p, "label": task.solve(*task.parse_prompt(p))} for p in ("47-5=", "09-3=")]
    out = evaluate_with_tools(model, tok, rows, temperature=1.0)
    assert 0.0 <= out["accuracy"] <= 1.0 and out["num"] == 2 and out["calls_per_sample"] >= 0


def test_prepare_cli_builds_the_agentic_task(tmp_path):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    try:
        import prepare_tiny_task
    finally:
        sys.path.pop(0)
    out = tmp_path / "tiny-tool"
    argv = ["--out", str(out), "--task", "subtract_tool", "--train-size", "30", "--eval-size", "6", "--sft-steps", "3",
            "--hidden-size", "32", "--num-layers", "1", "--p-call", "0.5"]
    first = prepare_tiny_task.prepare(prepare_tiny_task.parse_cli(argv))
    assert first["cached"] is False and 0 <= first["eval_tool_call_share_t1"] and "eval_accuracy_long_t1" not in first
    key = json.loads(json.loads((out / "model-sft" / "warm_start.json").read_text())["key"])
    assert key["task"] == "subtract_tool" and key["warm_start"]["p_call"] == 0.5 and key["warm_start"]["cap"] == 24
    rows = task.read_dataset(str(out / "eval.jsonl"))
    assert all(r["metadata"]["steps"] <= 24 for r in rows)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "model-sft"))
    assert tok.convert_tokens_to_ids("]") != tok.pad_token_id and tok.decode(tok.encode("[37-5]32", add_special_tokens=False)) == "[37-5]32"
    assert prepare_tiny_task.prepare(prepare_tiny_task.parse_cli(argv))["cached"] is True
