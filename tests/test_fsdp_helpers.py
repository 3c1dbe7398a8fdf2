"""Shared helpers for the FSDP trainer tests (no tests here)."""

from __future__ import annotations

import random
import json
import os

import torch

from slime.utils.types import Sample, Status

WORDS = list("0123456789+-=")


def make_model_dir(path, seed: int = 0, tie: bool = False) -> str:
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    tok = build_tokenizer(WORDS)
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=tie)
    build_tiny_qwen3(str(path), tok, spec, seed=seed)
    return str(path)


def make_args(hf_dir: str, *extra_argv: str, **over):
    """Real parsed flags (slime.arguments.parse_args) for a 2×4-sample rollout."""
    from slime.arguments import parse_args

    prompt_file = os.path.join(hf_dir, "prompts.jsonl")
    if not os.path.exists(prompt_file):
        with open(prompt_file, "w") as f:
            f.write(json.dumps({"prompt": "1+2=", "label": "3"}) + "\n")
    argv = [
        "--hf-checkpoint", hf_dir, "--prompt-data", prompt_file, "--rm-type", "math", "--num-rollout", "1",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "1e-3", "--adam-beta2", "0.999", "--seed", "1",
        "--calculate-per-token-loss", "--update-weight-buffer-size", str(1 << 14),
        # eager kernels on a GPU too (auto compiles there): tests compare numbers, not kernels, and a compile
        # costs tens of seconds per process; the compiled paths have their own tests
        "--compile-ops", "off",
        # fp32 on a GPU too (bf16 is the default there): tests compare numbers to 1e-5; a test that wants bf16
        # passes --bf16 (the last one wins)
        "--no-bf16", *extra_argv,
    ]
    args = parse_args(argv)
    return args.replace(**over) if over else args


def make_groups(n_groups: int = 2, group_size: int = 4, seed: int = 0, vocab: int = 16,
                rollout_log_probs=None) -> list[list[Sample]]:
    """Random prompt/response groups with distinct rewards inside each group."""
    rng = random.Random(seed)
    groups, idx = [], 0
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
        group = []
        for j in range(group_size):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
            s = Sample(index=idx, group_index=g, tokens=list(prompt))
            s.append_response(resp, [-1.0] * len(resp), 0)
            s.reward = float(j % 2) + 0.1 * j
            s.status = Status.COMPLETED
            group.append(s)
            idx += 1
        groups.append(group)
    return groups


def reference_log_probs(hf_dir: str, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """Plain transformers teacher forcing, one sample, no FSDP."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model_log_probs(model, sample, temperature)


@torch.no_grad()
def model_log_probs(model, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([sample.tokens])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    p = sample.prompt_length
    tgt = ids[0, p:]
    return logp[p - 1 : -1].gather(-1, tgt[:, None]).squeeze(-1)
