"""Which reasoning-gym task can SmolLM2-135M-Instruct learn here? Its starting accuracy on each candidate.

    python benchmarks/real_model_tasks.py [--n 64] [--names chain_sum_2t_1-2d ...] [--samples 8]

Per candidate (a reasoning-gym generator and its parameters), `--n` prompts as the real-model quick start writes them
(tools/convert_smollm2.py: the question plus the boxed-answer instruction, SmolLM2's chat template), answered greedily
by transformers' `generate` (up to --max-new tokens) and scored by the quick start's reward (the final number must
equal the answer: slime/tasks/final_number.py) and, beside it, by `--rm-type math` (math-verify, which also counts an
echoed question as its value): accuracy, the mean response length, and with --samples, at each --temperature, the
accuracy of samples and the share of prompts whose samples disagree (the groups GRPO learns from). One JSON line per
candidate. docs/real-model.md holds the table and the choice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tools")]

CANDIDATES = {
    "basic_arithmetic_2t_1-2d": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "basic_arithmetic_2t_1d": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "basic_arithmetic_2t_1d_add_sub": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                            "operators": ("+", "-"), "allow_negation": False}),
    "chain_sum_2t_1-2d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "chain_sum_2-3t_1d": ("chain_sum", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    "chain_sum_2t_2d": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    "leg_counting_1-2a_1-3i": ("leg_counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3}),
    "simple_equations_2t_1-10": ("simple_equations", {"min_terms": 2, "max_terms": 2, "min_value": 1, "max_value": 10}),
    "gsm_symbolic": ("gsm_symbolic", {}),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="runs/smollm2/model", help="converted when missing (tools/convert_smollm2.py)")
    p.add_argument("--names", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--n", type=int, default=64, help="prompts per candidate")
    p.add_argument("--seed", type=int, default=1_000_000, help="the quick start's held-out seed")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--samples", type=int, default=0, help="also this many samples per prompt at each --temperature")
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import convert_smollm2
    from slime.rollout.rm_hub.math_verify_reward import math_verify_reward
    from slime.tasks.final_number import compute_reward

    torch.set_num_threads(a.threads)
    convert_smollm2.convert(a.model)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()

    def generate(rows: list[dict], samples: int, temperature: float = 1.0) -> tuple[list[str], list[int]]:
        texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        how = (dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0, num_return_sequences=samples) if samples
               else dict(do_sample=False))
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=a.max_new, pad_token_id=tok.pad_token_id, **how)[:, enc.input_ids.shape[1]:]
        return ([tok.decode(o, skip_special_tokens=True) for o in out],
                [int((o != tok.pad_token_id).sum()) for o in out])

    def score(responses: list[str], labels: list[str]) -> list[float]:
        return [compute_reward(r, lab) for r, lab in zip(responses, labels)]

    async def score_math(responses: list[str], labels: list[str]) -> list[float]:
        return [await math_verify_reward(r, lab, 10.0) for r, lab in zip(responses, labels)]

    for name in a.names:
        task, config = CANDIDATES[name]
        t0 = time.monotonic()
        rows = convert_smollm2.reasoning_gym_rows(task, a.n, a.seed, config, distinct=True)
        labels = [r["label"] for r in rows]
        responses, lengths = generate(rows, 0)
        right = score(responses, labels)
        res = {"candidate": name, "task": task, "config": config, "prompts": a.n, "greedy_accuracy": sum(right) / a.n,
               "greedy_accuracy_math_verify": sum(asyncio.run(score_math(responses, labels))) / a.n,
               "greedy_response_tokens_mean": sum(lengths) / a.n, "example": [rows[0]["prompt"][0]["content"].split("\n")[0],
                                                                               responses[0][:120], labels[0]]}
        for t in a.temperature if a.samples else []:
            per_prompt, lengths = [], []
            for i in range(0, a.n, 8):
                chunk = rows[i:i + 8]
                out, n_tokens = generate(chunk, a.samples, t)
                got = score(out, [r["label"] for r in chunk for _ in range(a.samples)])
                per_prompt += [sum(got[j * a.samples:(j + 1) * a.samples]) for j in range(len(chunk))]
                lengths += n_tokens
            res[f"sampled_t{t}"] = {"accuracy": sum(per_prompt) / (a.n * a.samples),
                                    "prompts_with_mixed_samples": sum(0 < k < a.samples for k in per_prompt) / a.n,
                                    "response_tokens_mean": sum(lengths) / len(lengths)}
        res["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
