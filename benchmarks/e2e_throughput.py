"""End-to-end training throughput: synchronous vs APRIL vs one-step-off vs fully asynchronous.

The quick start's task and warm-started model (runs/tiny, built by tools/prepare_tiny_task.py when
missing) trained for the same number of steps, hence the same number of trained samples, in four modes:

    sync          train.py                          (rollout -> train -> push, nothing overlaps)
    april         train.py --partial-rollout        (APRIL: over-sample, abort at the target, park, resume)
    one_step_off  train_async.py                    (APRIL steps run one version ahead of the trainer)
    stream        train_async.py --rollout-mode stream  (a pool of requests in flight across steps)

Runs are interleaved (sync, april, one_step_off, stream, sync, ...) for --rounds rounds, so drift of the
box hits every mode alike. Each run is a real entry point in a subprocess. The trainer (the Ray actor
hosting FSDPTrainer) is pinned to --trainer-core; the embedded engine and the rest of the run (the
driver, whose rollout loop feeds the engine, the router, Ray's own processes) to --engine-core: the
rollout side on one core, the trainer on the other, one torch thread each. Ray starts its workers at
nice 15; the runs set RAY_worker_niceness=0 so the trainer has the same priority as the engine. The
final eval (--eval-samples samples per prompt of the 512 eval prompts, temperature 1) runs after the
last step.

Per mode (summed over rounds): wall time of the training loop (the steps' perf/step_time_s, eval time
taken out; start-up is excluded), trained samples/s, the engines' idle fraction (their scheduler's idle
counter over the loop), the trainer's idle fraction (1 - time spent training and pushing weights over the
loop), the off-policy token ratio and the mean staleness (policy versions between a trained token and
the policy that trained it), and the eval accuracy at the end (mean over rounds). The last line is JSON:
e2e_async_over_april, e2e_async_over_sync (trained samples/s ratios), accuracy_async, accuracy_sync.

    python benchmarks/e2e_throughput.py [--steps 80] [--rounds 2] [--modes sync april one_step_off stream]
    python benchmarks/e2e_throughput.py --modes stream_abort stream_retract stream_in_place   # --pause-mode
    python benchmarks/e2e_throughput.py --rounds 1 --modes april_cap_no_guard april_cap_guard \
        stream_cap_no_guard stream_cap_guard   # the length guard off / on under the quick start's cap

With the cap's modes a second table gives the length bias (slime/utils/summary.py's means over the steps): the
longest decile's share, and with `sync` among the modes the same against the measured sync run (pooled finished
lengths, rollout_trace.jsonl: not stream mode); trained length mean / p90 against the synchronous estimate; how
often the guard acted (samples masked instead of restarted; steps where it did).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

import psutil

from slime.utils.summary import guard_summary, length_bias_summary

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger("e2e_throughput")

CAP = ["--max-staleness", "4", "--staleness-policy", "restart"]  # scripts/quickstart.sh's
MODES = {
    "sync": ("train.py", []),
    "april": ("train.py", ["--partial-rollout", "--over-sampling-batch-size", "16"]),
    "one_step_off": ("train_async.py", ["--partial-rollout", "--over-sampling-batch-size", "16"]),
    "stream": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream"]),
    # stream mode by --pause-mode (how each weight update reaches the requests in flight; "stream" is the default's)
    "stream_abort": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream", "--pause-mode", "abort"]),
    "stream_retract": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream", "--pause-mode", "retract"]),
    "stream_in_place": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream", "--pause-mode", "in_place"]),
    # the length guard off / on (on is the default) under the quick start's cap, APRIL and stream
    "april_cap_no_guard": ("train.py", ["--partial-rollout", "--over-sampling-batch-size", "16", *CAP,
                                        "--disable-length-guard"]),
    "april_cap_guard": ("train.py", ["--partial-rollout", "--over-sampling-batch-size", "16", *CAP]),
    "stream_cap_no_guard": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream", *CAP,
                                               "--disable-length-guard"]),
    "stream_cap_guard": ("train_async.py", ["--partial-rollout", "--rollout-mode", "stream", *CAP]),
}
GUARD_MODES = ["april_cap_no_guard", "april_cap_guard", "stream_cap_no_guard", "stream_cap_guard"]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def quick_start_cmd(opts, mode: str, run_dir: str) -> list[str]:
    """scripts/quickstart.sh's training command for `mode` (same task, model, batch and algorithm)."""
    entry, extra = MODES[mode]
    w = opts.work
    if mode.startswith("stream"):
        extra = extra + ["--rollout-pool-size", str(opts.pool_size)]
    return [sys.executable, os.path.join(REPO, entry),
            "--hf-checkpoint", f"{w}/model-sft", "--prompt-data", f"{w}/train.jsonl", "--input-key", "prompt",
            "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rollout-seed", str(opts.seed),
            "--seed", str(opts.seed), "--rm-type", "subtract_chain", "--num-rollout", str(opts.steps),
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "192",
            "--rollout-temperature", "1.0", "--advantage-estimator", "grpo", "--calculate-per-token-loss", "--use-tis",
            "--lr", "1e-4", "--global-batch-size", "64", "--micro-batch-size", "16",
            "--eval-prompt-data", "tiny", f"{w}/eval.jsonl", "--eval-interval", str(opts.steps),
            "--eval-temperature", "1.0", "--eval-max-response-len", "192",
            "--n-samples-per-eval-prompt", str(opts.eval_samples), "--embedded-engine-threads", "1",
            "--train-num-threads", "1", "--run-dir", run_dir, "--no-use-wandb", *extra]


class Pinner(threading.Thread):
    """Pins the run's trainer actor to one core and every other process of the run to another, as they appear."""

    def __init__(self, root_pid: int, engine_core: int, trainer_core: int, metrics_path: str):
        super().__init__(daemon=True)
        self.root, self.cores = root_pid, {"engine": {engine_core}, "trainer": {trainer_core}}
        self.metrics_path = metrics_path
        self.cpu_at_loop: dict[int, tuple[str, float]] | None = None  # when the first metrics line appears
        self.pinned: dict[int, str] = {}
        self.cpu: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds when last seen)
        self.stop = threading.Event()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time each kind of process used from the start of the training loop (the first metrics line:
        the starting eval) to the end of the run (as sampled every 0.5 s)."""
        base = self.cpu_at_loop or {}
        out: dict[str, float] = {}
        for pid, (kind, secs) in self.cpu.items():
            out[kind] = out.get(kind, 0.0) + secs - (base[pid][1] if pid in base else 0.0)
        return out

    def _kind(self, proc: psutil.Process) -> str:
        if proc.pid == self.root:
            return "driver"
        cmd = " ".join(proc.cmdline())
        if "FSDPTrainer" in cmd:  # Ray names an actor's worker process ray::FSDPTrainer
            return "trainer"
        if "slime.backends.hf_engine" in cmd:
            return "engine"
        return "router" if "router" in cmd else "ray"

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root)
                procs = [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    kind = self._kind(p)
                    t = p.cpu_times()
                    self.cpu[p.pid] = (kind, t.user + t.system)
                    # every thread, every round: affinity is per thread on Linux, and a Ray worker becomes the
                    # trainer only once the actor is placed in it (its threads then move with it)
                    cores = self.cores["trainer" if kind == "trainer" else "engine"]
                    for th in p.threads():
                        try:
                            if os.sched_getaffinity(th.id) != cores:
                                os.sched_setaffinity(th.id, cores)
                        except (ProcessLookupError, PermissionError):
                            continue
                    self.pinned[p.pid] = kind
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            if self.cpu_at_loop is None and os.path.isfile(self.metrics_path) and os.path.getsize(self.metrics_path):
                self.cpu_at_loop = dict(self.cpu)
            self.stop.wait(0.5)


def run_mode(opts, mode: str, round_id: int) -> dict:
    run_dir = os.path.join(opts.out, f"{mode}-r{round_id}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    cmd = quick_start_cmd(opts, mode, run_dir)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "RAY_worker_niceness": "0"}
    load_before = load()
    t0 = time.monotonic()
    with open(os.path.join(run_dir, "stdout.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        pinner = Pinner(proc.pid, opts.engine_core, opts.trainer_core, os.path.join(run_dir, "metrics.jsonl"))
        pinner.start()
        try:
            rc = proc.wait(timeout=opts.run_timeout)
        except BaseException:  # timed out or interrupted: the run (and the engines it started) must not linger
            proc.terminate()  # its engines, router and Ray processes die with it (as after a kill -9)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        finally:
            pinner.stop.set()
    if rc != 0:
        raise RuntimeError(f"{mode} round {round_id} failed with exit code {rc}; see {run_dir}/stdout.log")
    kinds = sorted(pinner.pinned.values())  # (the driver, router and Ray's processes share the engine's core)
    if kinds.count("engine") < 1 or kinds.count("trainer") < 1:
        logger.warning("%s round %d: pinned only %s (engine and trainer share cores)", mode, round_id, kinds)
    stats = run_stats(os.path.join(run_dir, "metrics.jsonl"))
    stats.update(mode=mode, round=round_id, total_s=time.monotonic() - t0, load_before=load_before, load_after=load(),
                 cpu_s=pinner.cpu_seconds())
    print(f"  {mode:<13} round {round_id}: loop {stats['wall_s']:6.1f}s  {stats['samples_per_s']:6.1f} samples/s  "
          f"eval acc {stats['accuracy']:.3f}  (whole run {stats['total_s']:.0f}s, load {load_before} -> {stats['load_after']}; "
          f"CPU s: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(stats["cpu_s"].items())) + ")", flush=True)
    return stats


def run_stats(path: str) -> dict:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in rows if r["step"] >= 0]
    eval_s = sum(r.get("perf/eval_time_s", 0.0) for r in steps)
    wall = sum(r["perf/step_time_s"] for r in steps) - eval_s
    lags: dict[int, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("rollout/staleness_hist/lag_"):
                lag = int(k.rsplit("_", 1)[1])
                lags[lag] = lags.get(lag, 0.0) + v
    tokens = sum(lags.values())
    final = [r for r in rows if r.get("eval/accuracy") is not None]
    return {
        "wall_s": wall,
        "samples": sum(r.get("train/num_samples", 0.0) for r in steps),
        "samples_per_s": sum(r.get("train/num_samples", 0.0) for r in steps) / wall,
        "engine_idle_s": sum(r.get("perf/engine_idle_s", 0.0) for r in steps),
        "trainer_busy_s": sum(r["perf/trainer_busy_s"] for r in steps),
        "trained_tokens": tokens,
        "off_policy_tokens": sum(v for lag, v in lags.items() if lag > 0),
        "lag_tokens": sum(lag * v for lag, v in lags.items()),
        "accuracy_start": final[0]["eval/accuracy"] if len(final) > 1 else None,
        "accuracy": final[-1]["eval/accuracy"] if final else float("nan"),
        "eval_s": eval_s,
        **length_bias_summary(steps), **guard_summary(steps),
    }


def summarize(results: list[dict], modes: list[str]) -> dict[str, dict]:
    out = {}
    for m in modes:
        runs = [r for r in results if r["mode"] == m]
        wall = sum(r["wall_s"] for r in runs)
        tokens = sum(r["trained_tokens"] for r in runs) or 1.0
        out[m] = {
            "wall_s": wall,
            "samples_per_s": sum(r["samples"] for r in runs) / wall,
            "engine_idle": sum(r["engine_idle_s"] for r in runs) / wall,
            "trainer_idle": 1.0 - sum(r["trainer_busy_s"] for r in runs) / wall,
            "off_policy_ratio": sum(r["off_policy_tokens"] for r in runs) / tokens,
            "mean_staleness": sum(r["lag_tokens"] for r in runs) / tokens,
            "accuracy": sum(r["accuracy"] for r in runs) / len(runs),
            "accuracy_runs": [round(r["accuracy"], 4) for r in runs],
            "samples_per_s_runs": [round(r["samples_per_s"], 2) for r in runs],
            **{k: _mean([r[k] for r in runs]) for k in runs[0] if k.startswith(("length_", "guard_"))},
        }
    return out


def finished_lengths(run_dir: str) -> list[int]:
    """Every finished group's response lengths over the run (rollout_trace.jsonl; stream mode writes none)."""
    path = os.path.join(run_dir, "rollout_trace.jsonl")
    if not os.path.isfile(path):
        return []
    return [x for line in open(path) if line.strip() for g in json.loads(line).get("finished_lengths", []) for x in g]


def share_vs_sync(lengths: list[int], sync: list[int]) -> float | None:
    """The longest decile's share against the measured synchronous run (not an estimate): P(length >= the sync
    run's p90) here over the same in the sync run, each pooled over its whole run."""
    if not lengths or not sync:
        return None
    xs = sorted(sync)
    p90 = xs[int(0.9 * len(xs))]
    return (sum(x >= p90 for x in lengths) / len(lengths)) / (sum(x >= p90 for x in xs) / len(xs))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def print_length_table(s: dict[str, dict]) -> None:
    f = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)  # noqa: E731
    print(f"\n{'mode':<20} {'longest decile':>14} {'vs sync run':>11} {'trained mean/p90':>17} {'sync mean/p90':>14} "
          f"{'guard masked':>13} {'guard steps':>12}")
    for m, v in s.items():
        print(f"{m:<20} {f(v.get('length_longest_decile_share')):>14} {f(v.get('length_share_vs_sync_run')):>11} "
              f"{f(v.get('length_trained_mean'), '.1f') + ' / ' + f(v.get('length_trained_p90'), '.1f'):>17} "
              f"{f(v.get('length_sync_mean'), '.1f') + ' / ' + f(v.get('length_sync_p90'), '.1f'):>14} "
              f"{f(v.get('guard_masked_samples'), '.0f'):>13} {f(v.get('guard_steps'), '.0f'):>12}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=80, help="training steps per run (64 samples each), as the quick start")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every mode")
    p.add_argument("--modes", nargs="+", default=["sync", "april", "one_step_off", "stream"], choices=list(MODES))
    p.add_argument("--work", default="runs/tiny", help="the quick start's task + model (built when missing)")
    p.add_argument("--out", default="runs/e2e_bench", help="run directories")
    p.add_argument("--pool-size", type=int, default=64, help="stream mode's --rollout-pool-size")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per eval prompt (512 prompts)")
    p.add_argument("--engine-core", type=int, default=0)
    p.add_argument("--trainer-core", type=int, default=1)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts.work = os.path.abspath(opts.work)
    opts.out = os.path.abspath(opts.out)
    if not os.path.isfile(os.path.join(opts.work, "model-sft", "warm_start.json")):
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "prepare_tiny_task.py"), "--out", opts.work], check=True)
    cores = os.cpu_count() or 1
    if max(opts.engine_core, opts.trainer_core) >= cores or opts.engine_core == opts.trainer_core:
        raise SystemExit(f"--engine-core/--trainer-core must be two different cores below {cores}")
    print(f"e2e throughput: {opts.steps} steps x 64 samples per run, modes {opts.modes}, {opts.rounds} round(s); "
          f"engine on core {opts.engine_core}, trainer on core {opts.trainer_core}; load {load()}", flush=True)
    results = []
    for r in range(opts.rounds):
        for m in opts.modes:
            results.append(run_mode(opts, m, r))
    s = summarize(results, opts.modes)
    if "sync" in s:  # the longest decile against the measured synchronous run (round 0's)
        sync = finished_lengths(os.path.join(opts.out, "sync-r0"))
        for m in s:
            s[m]["length_share_vs_sync_run"] = share_vs_sync(finished_lengths(os.path.join(opts.out, f"{m}-r0")), sync)
    print(f"\n{'mode':<13} {'wall s':>8} {'samples/s':>10} {'engine idle':>12} {'trainer idle':>13} {'off-policy':>11} "
          f"{'staleness':>10} {'eval acc':>9}")
    for m, v in s.items():
        print(f"{m:<13} {v['wall_s']:8.1f} {v['samples_per_s']:10.2f} {v['engine_idle']:12.2f} {v['trainer_idle']:13.2f} "
              f"{v['off_policy_ratio']:11.3f} {v['mean_staleness']:10.3f} {v['accuracy']:9.3f}")
    if any(m in GUARD_MODES for m in s):
        print_length_table(s)
    print(f"per-run samples/s: " + "; ".join(f"{m} {v['samples_per_s_runs']}" for m, v in s.items()))
    print(f"per-run eval accuracy: " + "; ".join(f"{m} {v['accuracy_runs']}" for m, v in s.items()))
    print(f"load average at the end: {load()}")
    final = {"steps": opts.steps, "rounds": opts.rounds, "load_end": load(),
             "modes": {m: {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items()} for m, v in s.items()}}
    if "stream" in s:
        if "april" in s:
            final["e2e_async_over_april"] = round(s["stream"]["samples_per_s"] / s["april"]["samples_per_s"], 3)
        if "sync" in s:
            final["e2e_async_over_sync"] = round(s["stream"]["samples_per_s"] / s["sync"]["samples_per_s"], 3)
        final["accuracy_async"] = round(s["stream"]["accuracy"], 4)
    if "sync" in s:
        final["accuracy_sync"] = round(s["sync"]["accuracy"], 4)
    print(json.dumps(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
