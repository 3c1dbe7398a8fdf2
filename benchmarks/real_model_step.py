"""A step of the real-model run against the box's limit: the real-model quick start (scripts/quickstart_real_model.sh:
SmolLM2-135M-Instruct in fp32, `train.py` with FSDP, the embedded engine and APRIL) for a few steps, timed.

    python benchmarks/real_model_step.py [--steps 4] [--threads 2] [--work runs/real-model-step] [-- train.py flags]

Prints every step's time split (rollout, train, weight push, the rest), then the engine's decode and the trainer's
achieved GFLOP/s and their share of the box's fp32 matmul rate. The rate is measured in this process right before
and right after the run (two 1024 x 1024 fp32 matrices at --threads threads, the median of 0.3 s windows), by
torch.matmul (MKL's sgemm) and by oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`), and the shares are taken
against the faster one's mean: on AMD CPUs MKL runs AVX2 code, half an AVX-512 core's rate, so torch.matmul alone
understates the box (the share against it is printed too). Both probes are printed, with the load average. The
last line is JSON.

FLOPs are model FLOPs (what the work needs, not what the kernels execute), per token:
  body       2 x N_body, N_body = the decoder layers' matmul weights (q, k, v, o, gate, up, down projections);
  head       2 x V x H (vocabulary x hidden), only where a token's logits are needed;
  attention  4 x layers x query heads x head dim per key a query attends (QK^T and PV).
  Engine decode: every row of a decode-only step is one token through body and head, attending its cached keys and
    its own (the engine's counters decode_rows, decode_ctx_tokens over decode_s, from /get_server_info, polled while
    the run goes on). Prefill, and rows decoded in steps that also prefill, are not in this share.
  Trainer: the update's forward is body for every token (prompt and response), head for the response tokens (the
    log-prob head computes no others), attention over each sample's causal pairs (from the step's mean sample
    length); backward = 2 x forward; plus a forward when the old log-probs had their own (train/old_logprob_forward).
    Over train/train_time_s (the whole trainer call: data, old log-probs, update).
  Not counted: the embedding lookup, norms, element-wise work, the log-prob head's recompute in the backward.

The run is the quick start's own command (its task, reward, batch, APRIL settings and micro-batches) without its
evaluations, with both sides at --threads torch threads: in train.py the engine and the trainer take turns, so each
can use the whole box. Measure on a quiet box: with other work on it, two threads slow the engine down (each of a
decode step's ~3,000 torch ops that runs on both threads waits for both to be scheduled: a rollout of 161 s at load ~9 against
41 s with one thread at load ~12).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def matmul_rate(threads: int, seconds: float = 3.0, n: int = 1024) -> dict[str, float]:
    """GFLOP/s of torch.matmul (MKL) and of oneDNN's matmul on two n x n fp32 matrices at `threads` threads (median of
    0.3 s windows each); oneDNN's is absent where torch has no oneDNN."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    kernels = {"torch_matmul": lambda: a @ b}
    if torch.backends.mkldnn.is_available():
        kernels["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    out = {}
    try:
        for name, fn in kernels.items():
            fn()
            rates, end = [], time.perf_counter() + seconds / len(kernels)
            while time.perf_counter() < end:
                t0, k = time.perf_counter(), 0
                while time.perf_counter() - t0 < 0.3:
                    fn()
                    k += 1
                rates.append(2 * n**3 * k / (time.perf_counter() - t0) / 1e9)
            out[name] = statistics.median(rates)
        return out
    finally:
        torch.set_num_threads(before)


class ModelShape:
    """The model's FLOP terms (see the module docstring) from its config.json."""

    def __init__(self, model_dir: str):
        with open(os.path.join(model_dir, "config.json")) as f:
            c = json.load(f)
        h, ffn, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
        heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
        d = c.get("head_dim") or h // heads
        self.body = layers * (h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * ffn)
        self.head = c["vocab_size"] * h
        self.attn_per_key = 4 * layers * heads * d

    def decode_flops(self, rows: int, ctx_tokens: int) -> float:
        return 2.0 * (self.body + self.head) * rows + self.attn_per_key * (ctx_tokens + rows)

    def train_flops(self, tokens: float, response_tokens: float, samples: float, old_forward: bool) -> float:
        n = tokens / max(samples, 1.0)
        forward = 2.0 * self.body * tokens + 2.0 * self.head * response_tokens + \
            self.attn_per_key * samples * n * (n + 1) / 2
        return forward * (3 + (1 if old_forward else 0))


class EngineStats(threading.Thread):
    """Polls the run's engine (its URL from its log) for its scheduler's counters until stopped; keeps the last."""

    def __init__(self, log_path: str):
        super().__init__(daemon=True)
        self.log_path, self.url, self.last = log_path, None, None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            if self.url is None:
                try:
                    with open(self.log_path) as f:
                        m = re.search(r"hf_engine serving .* on (http://\S+)", f.read())
                    self.url = m.group(1) if m else None
                except OSError:
                    continue
            if self.url is not None:
                try:
                    with urllib.request.urlopen(self.url + "/get_server_info", timeout=5) as r:
                        self.last = json.load(r)["internal_states"][0]["scheduler_stats"]
                except (OSError, ValueError, KeyError):
                    pass  # between steps, or shut down


def run_quick_start(o) -> tuple[list[dict], dict | None, float]:
    run_dir = os.path.join(o.work, "run")
    cmd = ["bash", os.path.join(REPO, "scripts", "quickstart_real_model.sh"), "--skip-eval-before-train",
           "--eval-interval", str(o.steps + 1), "--embedded-engine-threads", str(o.threads),
           "--train-num-threads", str(o.threads), *o.extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
           "SLIME_SKIP_INSTALL": "1", "WORK": o.work, "RUN": run_dir, "STEPS": str(o.steps),
           "EVAL_NUM": "8", "PYTHON": sys.executable,
           "RAY_worker_niceness": "0"}  # Ray's workers (trainer, engine) at the driver's priority, not Ray's default 15
    shutil.rmtree(os.path.join(run_dir, "engine_logs"), ignore_errors=True)
    poll = EngineStats(os.path.join(run_dir, "engine_logs", "engine_0.log"))
    poll.start()
    t0 = time.perf_counter()
    os.makedirs(o.work, exist_ok=True)
    with open(os.path.join(o.work, "train.log"), "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=o.timeout).returncode
    wall = time.perf_counter() - t0
    poll.done.set()
    poll.join()
    if rc != 0:
        raise SystemExit(f"the quick start exited {rc}: see {os.path.join(o.work, 'train.log')}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("step", -1) >= 0]
    return rows, poll.last, wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="train.py steps (--num-rollout)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the engine and of the trainer")
    p.add_argument("--work", default=os.path.join(REPO, "runs", "real-model-step"))
    p.add_argument("--timeout", type=float, default=3600)
    o, extra = p.parse_known_args(argv)
    o.extra = [x for x in extra if x != "--"]
    load0, rate0 = load_avg(), matmul_rate(o.threads)
    rows, eng, wall = run_quick_start(o)
    shape = ModelShape(os.path.join(o.work, "model"))
    load1, rate1 = load_avg(), matmul_rate(o.threads)
    mean = {k: (rate0[k] + rate1[k]) / 2 for k in rate0}
    rate, mkl = max(mean.values()), mean["torch_matmul"]

    for k in rate0:
        print(f"matmul rate, {k} ({o.threads} threads, fp32 1024^3): {rate0[k]:.1f} GFLOP/s before (load {load0}), "
              f"{rate1[k]:.1f} after (load {load1})")
    print(f"{'step':>4} {'step s':>7} {'rollout':>8} {'train':>7} {'push':>6} {'other':>6} {'new tok':>8} "
          f"{'train tok':>9} {'old fwd':>7} {'trainer GFLOP/s':>15}")
    train_fl = train_s = 0.0
    for r in rows:
        step, roll, tr = r["perf/step_time_s"], r["perf/rollout_s"], r.get("perf/train_s", 0.0)
        push = r.get("perf/weight_push_s", 0.0)
        old = bool(r.get("train/old_logprob_forward", 1.0))
        fl = shape.train_flops(r.get("train/num_tokens", 0.0), r.get("rollout/trained_tokens", 0.0),
                               r.get("train/num_samples", 0.0), old)
        ts = r.get("train/train_time_s", 0.0)
        train_fl, train_s = train_fl + fl, train_s + ts
        print(f"{r['step']:>4} {step:>7.1f} {roll:>8.1f} {tr:>7.1f} {push:>6.1f} {step - roll - tr - push:>6.1f} "
              f"{r.get('rollout/new_tokens', 0):>8.0f} {r.get('train/num_tokens', 0):>9.0f} {int(old):>7} "
              f"{fl / max(ts, 1e-9) / 1e9:>15.1f}")
    steps = [r["perf/step_time_s"] for r in rows]
    out = {"load_before": load0, "load_after": load1, "matmul_gflops_before": rate0, "matmul_gflops_after": rate1,
           "matmul_gflops": rate, "threads": o.threads, "steps": len(rows), "step_s_mean": statistics.mean(steps), "step_s_max": max(steps),
           "wall_s": wall, "trainer_gflops": train_fl / max(train_s, 1e-9) / 1e9}
    out["trainer_share"] = out["trainer_gflops"] / rate
    out["trainer_share_torch_matmul"] = out["trainer_gflops"] / mkl
    if eng:
        dec_fl = shape.decode_flops(eng["decode_rows"], eng["decode_ctx_tokens"])
        out.update(decode_s=eng["decode_s"], decode_steps=eng["decode_steps"], decode_rows=eng["decode_rows"],
                   prefill_s=eng["prefill_s"], prefill_tokens=eng["prefill_tokens"],
                   shared_prompt_tokens=eng.get("shared_prompt_tokens", 0),
                   decode_gflops=dec_fl / max(eng["decode_s"], 1e-9) / 1e9)
        out["decode_share"] = out["decode_gflops"] / rate
        out["decode_share_torch_matmul"] = out["decode_gflops"] / mkl
        print(f"engine decode: {eng['decode_rows']} rows in {eng['decode_steps']} decode-only steps "
              f"({eng['decode_rows'] / max(eng['decode_steps'], 1):.1f} rows/step), {eng['decode_s']:.1f} s: "
              f"{out['decode_gflops']:.1f} GFLOP/s = {100 * out['decode_share']:.0f}% of the matmul rate "
              f"({100 * out['decode_share_torch_matmul']:.0f}% of torch.matmul's); prefill "
              f"{eng['prefill_tokens']} tokens in {eng['prefill_s']:.1f} s")
    else:
        print("engine decode: no counters (the engine's log gave no URL)")
    print(f"trainer: {out['trainer_gflops']:.1f} GFLOP/s = {100 * out['trainer_share']:.0f}% of the matmul rate "
          f"({100 * out['trainer_share_torch_matmul']:.0f}% of torch.matmul's); "
          f"step mean {out['step_s_mean']:.1f} s, max {out['step_s_max']:.1f} s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
