"""Rule-reward throughput: calls/s of `--rm-type deepscaler`, `dapo` and `math` on 1,000 mixed cases.

    taskset -c 0 python benchmarks/reward_throughput.py [--cases 1000] [--seed 0] [--repeats 3]

Cases are generated (seeded) in DeepScaleR / DAPO-Math style: a ~1.5k-character reasoning block, then
the answer (`\\boxed{...}` for deepscaler and math, an `Answer:` line for dapo), often followed by an EOS
text. Half are right, written in another form of the label's value (`\\frac{2}{4}` for `0.5`, `\\sqrt{27}`
for `3\\sqrt{3}`, `1+x^2` for `x^2+1`, `45^\\circ`, `\\text{(B)}`...), half wrong (another value, or a
decimal approximation of an irrational label). Each call goes through `async_rm`, the path the rollout
uses, one at a time on one event loop. Reported: calls/s (best of --repeats passes), the share scored
right, and for `math` the share that needed math-verify (the slow path runs only after the cheap
match could not decide). Targets (one core): deepscaler >= 3,000/s, dapo >= 10,000/s, math >= 200/s.
Indicative only: the box is shared; run it pinned to one core and say how loaded the box was.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import random
import tempfile
import time
from unittest import mock

from slime.arguments import parse_args
from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample, Status

# the module (the package re-exports a function of the same name)
math_rm = importlib.import_module("slime.rollout.rm_hub.math_verify_reward")

TARGETS = {"deepscaler": 3000.0, "dapo": 10000.0, "math": 200.0}
EOS = ["<|im_end|>", "<|endoftext|>", ""]
WORDS = "we consider the cases carefully and substitute back so that the sum of terms equals".split()


def _reasoning(rng: random.Random, chars: int = 1500) -> str:
    out, n = [], 0
    while n < chars:
        w = rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(0, 999))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def _math_answer(rng: random.Random, right: bool) -> tuple[str, str]:
    """(label, predicted answer) of one kind, the answer right or wrong."""
    kind = rng.choices(["int", "frac", "decimal", "surd", "pi", "poly", "tuple", "choice", "unit"],
                       [35, 15, 8, 10, 6, 10, 6, 5, 5])[0]
    a, b = rng.randint(2, 99), rng.randint(2, 19)
    if kind == "int":
        label = str(a * b)
        pred = rng.choice([label, f"{label}.0", "{" + label + "}", f"x = {label}"]) if right else str(a * b + rng.choice([-1, 1, 10]))
    elif kind == "frac":
        label = f"\\frac{{{a}}}{{{b + a}}}"
        pred = rng.choice([f"\\dfrac{{{2 * a}}}{{{2 * (b + a)}}}", f"{a}/{b + a}", label]) if right else f"\\frac{{{b + a}}}{{{a}}}"
    elif kind == "decimal":
        label = f"\\frac{{{a}}}{{4}}"
        pred = (str(a / 4) if right else str(round(a / 3, 4)))
    elif kind == "surd":
        label = f"{b}\\sqrt{{3}}"
        pred = f"\\sqrt{{{3 * b * b}}}" if right else rng.choice([f"\\sqrt{{{3 * b * b + 1}}}", f"{b}\\sqrt{{2}}"])
    elif kind == "pi":
        label = f"{b}\\pi"
        pred = rng.choice([f"\\pi \\cdot {b}", f"{b} \\pi"]) if right else rng.choice([f"{b * 3.14159:.5f}", f"{b + 1}\\pi"])
    elif kind == "poly":
        label = f"x^2+{a}x+{b}"
        pred = f"{b}+{a}x+x^2" if right else f"x^2+{b}x+{a}"
    elif kind == "tuple":
        label = f"({a}, {b})"
        pred = f"\\left({a},{b}\\right)" if right else f"({b}, {a})"
    elif kind == "choice":
        letter = "ABCDE"[a % 5]
        label = letter
        pred = rng.choice([f"\\text{{({letter})}}", f"({letter})", letter]) if right else "ABCDE"[(a + 1) % 5]
    else:
        label = str(a)
        pred = rng.choice([f"{a}^\\circ", f"{a} \\text{{ cm}}", f"{a} degrees"]) if right else f"{a + 1} \\text{{ cm}}"
    return label, pred


def make_cases(rm_type: str, n: int, seed: int) -> list[Sample]:
    rng = random.Random(f"{seed}-{rm_type}")
    samples = []
    for i in range(n):
        right = i % 2 == 0
        if rm_type == "dapo":  # DAPO-Math labels are integers
            value = rng.randint(1, 99999)
            label = rng.choice([str(value), f"{value}.0"])
            shown = value if right else value + rng.choice([-1, 1, 100])
            pred = rng.choice([str(shown), f"${shown}$", f"{shown:,}", f"\\boxed{{{shown}}}", f"{shown} degrees"])
            response = f"<think>{_reasoning(rng)}</think>\nSo the result follows.\nAnswer: {pred}{rng.choice(EOS)}"
        else:
            label, pred = _math_answer(rng, right)
            response = f"<think>{_reasoning(rng)}</think>\nThe final answer is $\\boxed{{{pred}}}$.{rng.choice(EOS)}"
        samples.append(Sample(index=i, group_index=i, prompt="Q", response=response, label=label, status=Status.COMPLETED))
    rng.shuffle(samples)
    return samples


async def _score_all(args, samples: list[Sample]) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    rewards = [await async_rm(args, s) for s in samples]
    return time.perf_counter() - t0, rewards


def bench(rm_type: str, n: int, seed: int, repeats: int, workdir: str) -> dict:
    args = parse_args(["--hf-checkpoint", workdir, "--prompt-data", os.path.join(workdir, "p.jsonl"),
                       "--rollout-batch-size", "1", "--num-rollout", "1", "--rm-type", rm_type])
    samples = make_cases(rm_type, n, seed)
    slow = {"calls": 0}
    real = math_rm.math_verify_correct

    def counted(*a):
        slow["calls"] += 1
        return real(*a)

    best, rewards = float("inf"), []
    with mock.patch.object(math_rm, "math_verify_correct", counted):
        for _ in range(repeats):
            slow["calls"] = 0
            elapsed, rewards = asyncio.run(_score_all(args, samples))
            best = min(best, elapsed)
    right_value = 1.0
    return {"rm_type": rm_type, "cases": n, "calls_per_s": n / best, "target": TARGETS[rm_type],
            "share_scored_right": sum(r == right_value for r in rewards) / n,
            "share_slow_path": slow["calls"] / n if rm_type == "math" else 0.0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--types", default="deepscaler,dapo,math")
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "Timeout is disabled" on every parse
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{opts.cases} mixed cases per reward type (half right), best of {opts.repeats}; cores usable: {affinity}; "
          f"load average {os.getloadavg()[0]:.2f}")
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        open(os.path.join(workdir, "p.jsonl"), "w").write('{"prompt": "1"}\n')
        for rm_type in opts.types.split(","):
            r = bench(rm_type, opts.cases, opts.seed, opts.repeats, workdir)
            results.append(r)
            verdict = "ok" if r["calls_per_s"] >= r["target"] else "BELOW TARGET"
            extra = f", math-verify on {100 * r['share_slow_path']:.1f}% of calls" if rm_type == "math" else ""
            print(f"{rm_type:10s} {r['calls_per_s']:10,.0f} calls/s  (target {r['target']:,.0f}: {verdict}); "
                  f"scored right {100 * r['share_scored_right']:.1f}%{extra}", flush=True)
    print(json.dumps({"reward_throughput": results}))


if __name__ == "__main__":
    main()
