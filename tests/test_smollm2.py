"""A real model offline: SmolLM2-135M-Instruct, its chat template, reasoning-gym data and the real-model quick start."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model  # skipped only with SLIME_SKIP_REAL_MODEL=1 (tests/conftest.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import convert_smollm2  # noqa: E402

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


@pytest.mark.slow
def test_conversion_is_plain_fp32_and_cached(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads(open(os.path.join(smollm2_dir, "config.json")).read())
    assert "quantization_config" not in cfg
    assert os.path.exists(os.path.join(smollm2_dir, "model.safetensors"))
    assert convert_smollm2.is_converted(smollm2_dir)
    mtime = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    convert_smollm2.convert(smollm2_dir)  # cached: no rewrite
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == mtime

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6

    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    ids = tok(rendered, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "5" in text, text  # the dequantised weights still answer a trivial question


def test_train_and_held_out_sets_and_the_final_number_reward(tmp_path):
    from slime.arguments import parse_args
    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample

    train, held_out = convert_smollm2.write_train_and_eval(str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl"),
                                                           "chain_sum", CHAIN_SUM, 200, 50, 0, 100_000)
    train_rows = [json.loads(line) for line in open(train)]
    eval_rows = [json.loads(line) for line in open(held_out)]
    assert len(train_rows) == 200 and len(eval_rows) == 50
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(questions(eval_rows)) == 50  # distinct held-out questions (the training set may repeat one)
    assert not questions(train_rows) & questions(eval_rows)  # held out: no training question
    terms = [r["prompt"][0]["content"].split(": ")[1].split(" =")[0].split() for r in eval_rows]
    assert all(len(t) == 3 and all(len(x.lstrip("-")) <= 2 for x in t[::2]) for t in terms), terms[:3]  # 2 terms, <= 2 digits
    assert all("\\boxed{ANSWER}" in r["prompt"][0]["content"] for r in eval_rows)
    with pytest.raises(ValueError, match="--eval-seed"):  # reasoning-gym's item i of seed 1 is item i + 1 of seed 0
        convert_smollm2.write_train_and_eval(str(tmp_path / "a"), str(tmp_path / "b"), "chain_sum", CHAIN_SUM, 4, 4, 0, 1)

    # the quick start's reward, as train.py calls it: the final number (the last box, else the last number) must be
    # the answer; an echoed question is wrong, though `--rm-type math` (math-verify) reads it as its value
    flags = ["--hf-checkpoint", str(tmp_path), "--prompt-data", train, "--input-key", "prompt", "--label-key", "label",
             "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--num-rollout", "2"]
    args = parse_args([*flags, "--custom-rm-path", "slime.tasks.final_number.reward"])
    math_args = parse_args([*flags, "--rm-type", "math"])
    for row in eval_rows[:8]:
        label, question = row["label"], row["prompt"][0]["content"].split(": ")[1].split("\n")[0]  # "4 - 1 ="
        score = lambda response, a=args: asyncio.run(async_rm(a, Sample(prompt=row["prompt"], label=label, response=response)))  # noqa: E731
        assert score(f"The answer is \\boxed{{{label}}}.") == 1.0
        assert score(f"{question} {label}") == 1.0  # no box: the last number written
        assert score(f"\\boxed{{{int(label) + 7}}} though {label} came to mind") == 0.0  # the box wins
        assert score(f"{label} is what I would say, but it is {int(label) + 1}") == 0.0
        if question.split()[0] != "0" and question.split()[2] != label:  # an echo whose last operand is not the answer
            assert score(question) == 0.0 and score(question, math_args) == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_model_quick_start_two_april_steps(smollm2_dir, tmp_path):
    """README's real-model command for two steps, made small."""
    run = tmp_path / "run"
    env = {**os.environ, "SLIME_SKIP_INSTALL": "1", "WORK": str(tmp_path / "work"), "RUN": str(run), "STEPS": "2",
           "EVAL_INTERVAL": "2", "EVAL_NUM": "8", "TRAIN_NUM": "32", "PYTHONPATH": REPO}
    os.makedirs(env["WORK"])
    os.symlink(smollm2_dir, os.path.join(env["WORK"], "model"))  # converted once per session (tests/conftest.py)
    small = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "4",
             "--global-batch-size", "8", "--micro-batch-size", "8", "--rollout-max-response-len", "24",
             "--eval-max-response-len", "24", "--no-use-wandb"]
    proc = subprocess.run(["bash", "scripts/quickstart.sh", "--real-model", *small], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=840)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    steps = [r for r in rows if r["step"] >= 0 and "train/num_samples" in r]
    assert [r["step"] for r in steps] == [0, 1] and all(r["train/num_samples"] == 8 for r in steps)
    scores = [json.loads(line) for line in open(run / "eval_scores.jsonl")]
    assert [(s["step"], s["set"], len(s["scores"])) for s in scores] == [(-1, "held_out", 8), (1, "held_out", 8)]
    summary = json.loads((run / "summary.json").read_text())
    (gain,) = summary["eval_gains"]
    assert gain["prompts"] == 8 and gain["gain_interval"][0] <= gain["gain"] <= gain["gain_interval"][1]
    assert "eval gain: " in out and "(95% interval " in out
    assert (run / "plots" / "reward.png").is_file()
    audit = subprocess.run([sys.executable, "tools/audit_ledger.py", str(run / "ckpt")], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
