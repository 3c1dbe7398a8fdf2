"""The GPU main job's task: a model preset and prompts whose response budgets have the APRIL paper's shape.

    python benchmarks/main_job_task.py --out DIR [--model qwen3-0.5b | quickstart] [--model-cache DIR2] [--rows 4096]
        [--median 192] [--sigma 0.8] [--cap 512]

Writes the model preset into --model-cache (default DIR) as <model>/ (`slime.utils.tiny_model.build_preset`: random
weights, reused when already built there) and DIR/train.jsonl: subtract_chain problems (rows {"prompt", "label", "metadata"}), each with
`metadata.max_response_len` drawn from the log-normal that `tools/simulate_rollout.py paper` assumes for
DAPO-Math-17k on Qwen3-4B (median 6,000 tokens, sigma 0.8, cap 16,384), scaled down to `--median` / `--cap`
(the cap / median ratio kept near the paper's 2.7). A prompt's samples share its budget (a hard prompt is long
for all). With `--rollout-ignore-eos` every response runs to its budget, so a random model's rollout has the
length distribution of a reasoning model's; its rewards are ~0 (the job measures the machinery, not learning).
Prints one JSON line: the model dir, the data file and the budgets' quantiles.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from slime.rollout.simulator.lengths import LogNormalLengths
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.tiny_model import build_preset, build_tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-0.5b", choices=["qwen3-0.5b", "quickstart"])
    p.add_argument("--model-cache", default=None, help="build the model here, or reuse it from here (default: --out)")
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--median", type=float, default=192.0, help="median response budget (tokens)")
    p.add_argument("--sigma", type=float, default=0.8)
    p.add_argument("--cap", type=int, default=512, help="the longest budget (--rollout-max-response-len)")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args(argv)
    if opts.median <= 0 or opts.cap < 1 or opts.median > opts.cap:
        p.error(f"--median {opts.median} and --cap {opts.cap}: need 0 < median <= cap")
    os.makedirs(opts.out, exist_ok=True)
    model_dir = build_preset(opts.model, opts.model_cache or opts.out, build_tokenizer(VOCAB))
    data = os.path.join(opts.out, "train.jsonl")
    write_dataset(data, opts.rows, seed=opts.seed)
    lengths = LogNormalLengths(opts.median, opts.sigma, opts.cap)
    rng = random.Random(opts.seed)
    rows = [json.loads(line) for line in open(data)]
    budgets = []
    for row in rows:
        budgets.append(lengths.sample_group(rng, 1)[1][0])
        row["metadata"]["max_response_len"] = budgets[-1]
    with open(data + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(data + ".tmp", data)
    budgets.sort()
    workload = (f"log-normal response budgets: median {opts.median:g}, sigma {opts.sigma:g}, cap {opts.cap} "
                f"({100 * lengths.truncated_fraction():.1f}% at the cap), one per prompt (its samples share it)")
    print(json.dumps({"model_dir": model_dir, "data": data, "workload": workload,
                      "budget_median": budgets[len(budgets) // 2], "budget_p90": budgets[int(0.9 * len(budgets))],
                      "budget_max": budgets[-1]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
