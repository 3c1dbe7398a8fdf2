import json
import random

import numpy as np
import pytest

from slime.tasks import subtract_chain as task
from slime.utils.tiny_model import build_tokenizer


def test_solve_and_format():
    assert task.format_prompt(47, 5) == "47-5="
    assert task.solve(47, 5) == "42,37,32,27,22,17,12,07,02"
    assert task.solve(9, 3) == "06,03,00"
    assert task.solve(64, 1).split(",")[-1] == "00"
    assert len(task.solve(64, 1).split(",")) == 64
    assert task.parse_prompt("<bos>07-3=") == (7, 3)
    with pytest.raises(ValueError, match="NN-S="):
        task.parse_prompt("7-3=")
    with pytest.raises(ValueError):
        task.format_prompt(100, 3)


def test_problems_are_consistent():
    rng = random.Random(1)
    for _ in range(3000):
        prompt, answer, meta = task.make_problem_with_meta(rng)
        n, s = task.parse_prompt(prompt)
        assert (n, s) == (meta["n"], meta["s"])
        assert 1 <= s <= 9 and n <= 99
        values = [int(v) for v in answer.split(",")]
        assert len(values) == meta["steps"] == n // s
        assert values[-1] == n % s
        assert all(a - b == s for a, b in zip([n, *values], values))


def test_length_distribution_has_the_documented_tail():
    rng = random.Random(0)
    lengths = np.array([3 * task.make_problem_with_meta(rng)[2]["steps"] for _ in range(20000)])
    # response tokens = 2 digits + separator/EOS per number = 3 * steps
    assert 15.5 <= lengths.mean() <= 19.0
    assert 6 <= np.median(lengths) <= 9
    assert 27 <= np.percentile(lengths, 90) <= 36
    assert np.percentile(lengths, 99) == 3 * 64
    assert lengths.min() >= 3 and lengths.max() == 192
    # the cap and alpha set the tail
    rng = random.Random(0)
    short = np.array([task.make_problem_with_meta(rng, cap=16, alpha=2.0)[2]["steps"] for _ in range(5000)])
    assert short.max() <= 16 and short.mean() < lengths.mean() / 3


def test_response_tokens_match_three_per_step():
    tok = build_tokenizer(task.VOCAB)
    rng = random.Random(3)
    for _ in range(50):
        prompt, answer, meta = task.make_problem_with_meta(rng)
        ids = tok.encode(answer, add_special_tokens=False) + [tok.eos_token_id]
        assert len(ids) == 3 * meta["steps"]
        assert tok.decode(tok.encode(prompt, add_special_tokens=False)) == prompt
    rendered = tok.apply_chat_template([{"role": "user", "content": "47-5="}], tokenize=False)
    assert rendered == "<bos>47-5="
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 6  # BOS is one token after the chat template


def test_write_dataset_rows(tmp_path):
    path = tmp_path / "d" / "train.jsonl"
    task.write_dataset(str(path), 100, seed=7)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 100
    for row in rows:
        assert set(row) == {"prompt", "label", "metadata"}
        n, s = task.parse_prompt(row["prompt"])
        assert row["label"] == task.solve(n, s)
        assert row["metadata"]["steps"] == n // s
    task.write_dataset(str(tmp_path / "again.jsonl"), 100, seed=7)
    assert (tmp_path / "again.jsonl").read_text() == path.read_text()
    assert task.read_dataset(str(path))[0]["prompt"] == rows[0]["prompt"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "12-3="}\n')
    with pytest.raises(ValueError, match="row 1 has no field 'label'"):
        task.read_dataset(str(tmp_path / "bad.jsonl"))


def test_compute_reward():
    label = task.solve(47, 5)
    assert task.compute_reward(label, label) == 1.0
    assert task.compute_reward(label + "<eos>", label) == 1.0
    assert task.compute_reward(" " + label + " <eos>\n", label) == 1.0
    assert task.compute_reward(label + "<eos><pad><pad>", label) == 1.0
    assert task.compute_reward(label[:-3], label) == 0.0  # one number short
    assert task.compute_reward(label + ",00", label) == 0.0  # one too many
    assert task.compute_reward(label.replace("27", "28"), label) == 0.0
    assert task.compute_reward("", label) == 0.0
    assert task.compute_reward(label + "<eos>42", label) == 0.0


def test_noisy_teacher_error_rate():
    rng = random.Random(0)
    assert task.noisy_teacher("47-5=", rng, p=0.0) == task.solve(47, 5)
    wrong_steps = total_steps = 0
    correct = 0
    for _ in range(4000):
        prompt, answer = task.make_problem(rng)
        n, s = task.parse_prompt(prompt)
        out = task.noisy_teacher(prompt, rng, p=0.1)
        correct += out == answer
        values = [n] + [int(v) for v in out.split(",") if v]
        diffs = [a - b for a, b in zip(values, values[1:])]
        assert all(d >= 1 and abs(d - s) <= 2 for d in diffs)  # errors are s±1 or s±2
        assert values[-1] >= 0
        wrong_steps += sum(d != s for d in diffs)
        total_steps += len(diffs)
    assert 0.08 <= wrong_steps / total_steps <= 0.12
    assert 0.6 <= correct / 4000 <= 0.75  # leaves RL headroom
