"""APRIL beside synchronous on a real model, the APRIL paper's table in miniature: SmolLM2-135M-Instruct learning
reasoning-gym's chain_sum with GRPO (the real-model quick start, scripts/quickstart_real_model.sh, whose settings
this runs unchanged).

    python benchmarks/real_model.py                        # everything, one command (prints how long it took)
    python benchmarks/real_model.py --steps 2 --sglang-steps 0 --no-calibrate    # a smoke run
    python benchmarks/real_model.py -- --lr 2e-5           # extra train.py flags for every run (e.g. a GPU's)
    python benchmarks/real_model.py --reuse april          # read the finished APRIL arm in --out, run the rest

1. `bash scripts/quickstart.sh --real-model` with and without `--no-partial` on the embedded engine: the same
   prompts, seed and number of trained samples (--steps x 4 groups x 8); held-out eval accuracy against step and
   against wall time, trained samples/s, rollout tokens/s, the off-policy token share, response lengths and the
   length-bias metrics (docs/metrics.md).
2. The same two, shorter (--sglang-steps, no eval), on SGLang's own server (`--rollout-backend sglang`, the CPU venv
   of tools/sglang_cpu_env.py).
3. The embedded engine's tokens/s against requests in flight on this model (tools/simulate_rollout.py calibrate),
   and the rollout simulator's APRIL / sync from that cost model and the APRIL run's own lengths; beside it the same
   lengths on one H100 as the simulator models it (gpu_presets: a decode step that costs nearly the same at 1 row
   as at 64, where a half-empty batch is a loss; on two CPU cores decode is compute-bound and it costs little).

Writes <out>/real_model.md and <out>/real_model.json, and <out>/eval_curves.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from slime.rollout.simulator.cost_model import EngineCostModel  # noqa: E402
from slime.rollout.simulator.from_run import run_config  # noqa: E402
from slime.rollout.simulator.gpu_presets import gpu_cost_model  # noqa: E402
from slime.rollout.simulator.lengths import lengths_from_run, read_trace  # noqa: E402
from slime.rollout.simulator.simulate import simulate  # noqa: E402
from slime.utils.eval_scores import accuracy_interval, paired_gain, read_eval_scores  # noqa: E402
from slime.utils.summary import LAG_PREFIX  # noqa: E402

logger = logging.getLogger("real_model")
CURVE = "1,2,4,8,16,32,64"
ARMS = ("april", "sync", "sglang-april", "sglang-sync")


def load() -> float:
    return round(os.getloadavg()[0], 2)


def run_quickstart(opts, name: str, mode_args: list[str], steps: int, eval_interval: int, extra: list[str]) -> dict:
    """One run of the real-model quick start into <out>/<name>; its stats."""
    run_dir = os.path.join(opts.out, name)
    # a loaded box's engine steps can take a minute: the health check waits for them instead of calling the engine
    # dead (SGLang's own variable, which the embedded engine reads too); Ray's workers at the driver's priority
    env = {**os.environ, "SLIME_SKIP_INSTALL": os.environ.get("SLIME_SKIP_INSTALL", "1"), "WORK": opts.work,
           "RUN": run_dir, "STEPS": str(steps), "EVAL_INTERVAL": str(eval_interval),
           "SGLANG_HEALTH_CHECK_TIMEOUT": "240", "RAY_worker_niceness": "0",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    load_before, t0 = load(), time.monotonic()
    os.makedirs(opts.out, exist_ok=True)
    with open(os.path.join(opts.out, f"{name}.log"), "w") as log:
        rc = subprocess.run(["bash", "scripts/quickstart.sh", "--real-model", *mode_args,
                             "--rollout-health-check-timeout", "300", *extra], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{name}: the quick start failed with exit code {rc}; see {opts.out}/{name}.log")
    stats = run_stats(run_dir)
    stats.update(name=name, run_dir=run_dir, whole_run_s=round(time.monotonic() - t0, 1), load_before=load_before,
                 load_after=load())
    with open(os.path.join(opts.out, f"{name}.json"), "w") as f:  # what --reuse reads back
        json.dump({k: stats[k] for k in ("whole_run_s", "load_before", "load_after")}, f)
    print(f"  {name}: {stats['steps']} steps in {stats['loop_s']:.0f} s of loop ({stats['whole_run_s']:.0f} s whole), "
          f"{stats['samples_per_s']:.3f} samples/s, rollout {stats['rollout_tokens_per_s']:.1f} tok/s, eval "
          f"{_fmt_acc(stats.get('eval_first'))} -> {_fmt_acc(stats.get('eval_last'))}; load {load_before} -> "
          f"{stats['load_after']}", flush=True)
    return stats


def reused_stats(opts, name: str, steps: int) -> dict:
    """A finished arm of an earlier run of this benchmark, read from <out>/<name> instead of run again."""
    run_dir = os.path.join(opts.out, name)
    if not os.path.exists(os.path.join(run_dir, "summary.json")):
        raise SystemExit(f"--reuse {name}: {run_dir} holds no finished run (no summary.json)")
    stats = run_stats(run_dir)
    if stats["steps"] != steps:
        raise SystemExit(f"--reuse {name}: {run_dir} ran {stats['steps']} steps, this benchmark runs {steps}")
    saved = os.path.join(opts.out, f"{name}.json")  # its load and time, where the run that made it wrote them
    stats.update(json.load(open(saved)) if os.path.exists(saved) else
                 {"whole_run_s": None, "load_before": None, "load_after": None})
    stats.update(name=name, run_dir=run_dir, reused=True)
    print(f"  {name}: reused {run_dir} ({stats['steps']} steps, {stats['samples_per_s']:.3f} samples/s)", flush=True)
    return stats


def run_stats(run_dir: str) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    steps = [r for r in rows if r["step"] >= 0]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    total = lambda key: sum(r.get(key, 0.0) for r in steps)  # noqa: E731
    eval_s = total("perf/eval_time_s")
    loop = total("perf/step_time_s") - eval_s  # the evals are the same work in every mode: out of the loop's time
    lags: dict[int, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith(LAG_PREFIX):
                lags[int(k[len(LAG_PREFIX):])] = lags.get(int(k[len(LAG_PREFIX):]), 0.0) + v
    trained_tokens = sum(lags.values())
    # eval accuracy against step and against the loop's wall time so far (evals excluded)
    curve, elapsed = [], 0.0
    for r in rows:
        if r["step"] >= 0:
            elapsed += r.get("perf/step_time_s", 0.0) - r.get("perf/eval_time_s", 0.0)
        if r.get("eval/accuracy") is not None:
            curve.append({"step": r["step"], "loop_s": round(elapsed, 1), "accuracy": r["eval/accuracy"]})
    out = {
        "steps": len(steps), "samples": total("train/num_samples"), "loop_s": loop, "eval_s": eval_s,
        "samples_per_s": total("train/num_samples") / loop if loop else 0.0,
        "step_s": loop / len(steps) if steps else 0.0,
        "rollout_s": total("perf/rollout_s"), "train_s": total("perf/train_s"),
        "new_tokens": total("rollout/new_tokens"),
        "rollout_tokens_per_s": total("rollout/new_tokens") / total("perf/rollout_s") if total("perf/rollout_s") else 0.0,
        "off_policy_token_share": sum(v for lag, v in lags.items() if lag > 0) / trained_tokens if trained_tokens else 0.0,
        "max_lag": summary.get("max_lag"),
        "response_len_mean": _mean([r.get("rollout/response_len_mean") for r in steps]),
        **{k: summary.get(k) for k in ("length_trained_mean", "length_sync_mean", "length_trained_p90", "length_sync_p90",
                                       "length_longest_decile_share")},
        "reward_first_quarter": summary.get("reward_first_quarter"), "reward_last_quarter": summary.get("reward_last_quarter"),
        "eval_curve": curve,
    }
    gains = summary.get("eval_gains") or []
    if gains:
        g = gains[0]
        out.update(eval_first=g["before"], eval_last=g["after"], eval_gain=g["gain"], eval_gain_interval=g["gain_interval"],
                   eval_prompts=g["prompts"])
    return out


def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def _fmt_acc(a) -> str:
    return "n/a" if not a else f"{a[0]:.3f} [{a[1]:.3f}, {a[2]:.3f}]"


def april_vs_sync_final(april_dir: str, sync_dir: str) -> dict | None:
    """APRIL's last eval minus sync's, paired over the same held-out prompts (is sync the same within its noise?)."""
    a, s = read_eval_scores(april_dir), read_eval_scores(sync_dir)
    common = sorted(set(a) & set(s))
    if not common or len(a[common[0]]) < 2 or len(s[common[0]]) < 2:
        return None
    g = paired_gain(s[common[0]][-1], a[common[0]][-1])
    return {"difference": g["gain"], "interval": g["gain_interval"], "prompts": g["prompts"]}


def calibrate(opts) -> dict:
    """The embedded engine's cost model on this model and box (with its closed-loop tokens/s curve)."""
    path = os.path.join(opts.out, "cost_model.json")
    t0, load_before = time.monotonic(), load()
    subprocess.run([sys.executable, "tools/simulate_rollout.py", "calibrate", "--model-path", os.path.join(opts.work, "model"),
                    "--quick", "--passes", "2", "--curve", CURVE, "--out", path], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.DEVNULL)
    cost = EngineCostModel.load(path)
    return {"path": path, "curve_tok_s": cost.extra.get("curve_tok_s", {}), "seconds": round(time.monotonic() - t0, 1),
            "load_before": load_before, "load_after": load(), "describe": cost.describe()}


def simulate_modes(april_dir: str, cost: EngineCostModel) -> dict:
    """Sync and APRIL simulated on the APRIL run's configuration and lengths with `cost`: tokens/s and APRIL / sync."""
    cfg = run_config([r for r in read_trace(april_dir) if "target" in r])
    lengths = lengths_from_run(april_dir)
    cfg = cfg.replace(steps=max(cfg.steps, 12), warmup_steps=2)
    sync = simulate(cfg.replace(partial_rollout=False, over_sampling_batch_size=None), cost, lengths).summary()
    april = simulate(cfg, cost, lengths).summary()
    return {"engine": cost.name, "lengths": lengths.describe(), "sync_tokens_per_s": sync["tokens_per_s"],
            "april_tokens_per_s": april["tokens_per_s"], "april_over_sync": april["tokens_per_s"] / sync["tokens_per_s"],
            "april_off_policy_token_share": april["off_policy_token_ratio"],
            "engine_idle_sync": sync["engine_idle_fraction"], "engine_idle_april": april["engine_idle_fraction"]}


def plot_curves(runs: dict[str, dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, st in runs.items():
        c = st["eval_curve"]
        ax1.plot([max(p["step"] + 1, 0) for p in c], [p["accuracy"] for p in c], "o-", label=name)
        ax2.plot([p["loop_s"] / 60 for p in c], [p["accuracy"] for p in c], "o-", label=name)
    ax1.set_xlabel("trained steps")
    ax2.set_xlabel("wall time of the training loop (min, evals excluded)")
    for ax in (ax1, ax2):
        ax.set_ylabel("held-out eval accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct on chain_sum: APRIL vs synchronous")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    runs = res["runs"]
    lines = [f"# APRIL vs synchronous on SmolLM2-135M-Instruct (chain_sum), {res['date']}", "",
             f"Box: {res['box']}; load (1-min) {res['load_start']} at the start, {res['load_end']} at the end; whole "
             f"benchmark {res['seconds'] / 60:.1f} min. Command: `{res['command']}`.", "",
             "| run | steps | trained samples | loop s | samples/s | rollout tok/s | off-policy tokens | response len mean "
             "| trained len mean / p90 (sync est.) | longest decile reaches training | held-out eval before -> after | "
             "gain (95% interval) | load |",
             "| --- " * 13 + "|"]
    f = lambda v, spec=".2f": "n/a" if v is None else format(v, spec)  # noqa: E731
    for name, st in runs.items():
        gain = ("n/a" if st.get("eval_gain") is None else
                f"{st['eval_gain']:+.3f} ({st['eval_gain_interval'][0]:+.3f} .. {st['eval_gain_interval'][1]:+.3f})")
        lines.append(
            f"| {name} | {st['steps']} | {st['samples']:.0f} | {st['loop_s']:.0f} | {st['samples_per_s']:.3f} | "
            f"{st['rollout_tokens_per_s']:.1f} | {st['off_policy_token_share']:.2f} | {f(st['response_len_mean'], '.1f')} | "
            f"{f(st['length_trained_mean'], '.1f')} / {f(st['length_trained_p90'], '.0f')} ({f(st['length_sync_mean'], '.1f')} / "
            f"{f(st['length_sync_p90'], '.0f')}) | {f(st['length_longest_decile_share'])} | {_fmt_acc(st.get('eval_first'))} -> "
            f"{_fmt_acc(st.get('eval_last'))} | {gain} | {f(st['load_before'], '')} -> {f(st['load_after'], '')} |")
    curves = {k: {p["step"]: p for p in v["eval_curve"]} for k, v in runs.items() if v["eval_curve"]}
    if curves:
        names = list(curves)
        lines += ["", "Held-out eval accuracy (greedy) against trained steps and the loop's wall time (evals excluded):", "",
                  "| after step | " + " | ".join(f"{n}: accuracy (min)" for n in names) + " |", "| --- " * (len(names) + 1) + "|"]
        for step in sorted({s for c in curves.values() for s in c}):
            cells = [f"{c[step]['accuracy']:.3f} ({c[step]['loop_s'] / 60:.1f})" if step in c else "" for c in curves.values()]
            lines.append(f"| {step + 1 if step >= 0 else 'start'} | " + " | ".join(cells) + " |")
    lines.append("")
    for backend, r in res["ratios"].items():
        lines.append(f"- {backend}: APRIL / sync trained samples/s {r['samples_per_s']:.2f}x, rollout tokens/s "
                     f"{r['rollout_tokens_per_s']:.2f}x.")
    if res.get("april_minus_sync"):
        d = res["april_minus_sync"]
        lines.append(f"- Final held-out accuracy, APRIL minus sync on the same {d['prompts']} prompts: {d['difference']:+.3f} "
                     f"(95% interval {d['interval'][0]:+.3f} .. {d['interval'][1]:+.3f}).")
    if res.get("engine"):
        e = res["engine"]
        lines += ["", f"Embedded engine on this model and box, closed loop (C requests always in flight, 16-token prompts, "
                      f"64 new tokens; calibration {e['seconds']:.0f} s, load {e['load_before']} -> {e['load_after']}):", "",
                  "| requests in flight | " + " | ".join(e["curve_tok_s"]) + " |",
                  "| --- " * (len(e["curve_tok_s"]) + 1) + "|",
                  "| tokens/s | " + " | ".join(f"{v:.0f}" for v in e["curve_tok_s"].values()) + " |"]
    for key, what in (("simulated_cpu", "this engine (calibrated above)"), ("simulated_gpu", "one H100 (modelled)")):
        if res.get(key):
            s = res[key]
            lines.append(f"- Simulator, the APRIL run's configuration and lengths on {what}: APRIL / sync rollout tokens/s "
                         f"{s['april_over_sync']:.2f}x ({s['sync_tokens_per_s']:.0f} -> {s['april_tokens_per_s']:.0f}; engine "
                         f"idle {s['engine_idle_sync']:.2f} -> {s['engine_idle_april']:.2f}).")
    if res.get("reading"):
        lines += ["", res["reading"]]
    return "\n".join(lines) + "\n"


def reading(res: dict) -> str:
    """What the numbers say about APRIL here, and what would change on a GPU."""
    r, cpu, gpu = res["ratios"].get("embedded"), res.get("simulated_cpu"), res.get("simulated_gpu")
    if not r:
        return ""
    a, s = res["runs"]["april"], res["runs"]["sync"]
    text = (f"APRIL trained {r['samples_per_s']:.2f}x the samples/s of sync on the embedded engine"
            + (f" (the simulator predicts {cpu['april_over_sync']:.2f}x for the rollout alone)" if cpu else "") + ": "
            f"rollout {a['rollout_s']:.0f} s against {s['rollout_s']:.0f} s, training {a['train_s']:.0f} s against "
            f"{s['train_s']:.0f} s (evals, the same work in both: {a['eval_s']:.0f} s against {s['eval_s']:.0f} s; "
            "a gap there is the box's load, not the mode). ")
    curve = (res.get("engine") or {}).get("curve_tok_s") or {}
    if curve:
        lo, hi = min(curve, key=int), max(curve, key=int)
        text += (f"On this box decode is compute-bound: {curve[hi]:.0f} tok/s at {hi} requests in flight vs "
                 f"{curve[lo]:.0f} at {lo} ({curve[hi] / max(curve[lo], 1e-9):.1f}x for {int(hi) // int(lo)}x the rows), "
                 "so the half-empty batches of a synchronous step's tail cost little and APRIL has little to win. ")
    if gpu:
        text += (f"On a GPU a decode step costs nearly the same at 1 row as at 64: the simulator gives APRIL "
                 f"{gpu['april_over_sync']:.2f}x sync on these lengths on one H100 (modelled), and the trainer's share of a "
                 "step shrinks with it.")
    return text


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--steps", type=int, default=None, help="steps of each embedded-engine run (default: the quick start's)")
    p.add_argument("--sglang-steps", type=int, default=6, help="steps of each run on SGLang's own server (0: none)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the engine curve and the simulator")
    p.add_argument("--reuse", default="", help="comma-separated arms (april, sync, sglang-april, sglang-sync) whose "
                   "finished runs in --out are read instead of run again")
    p.add_argument("--work", default="runs/smollm2", help="the quick start's model and data (WORK)")
    p.add_argument("--out", default="runs/real_model_bench")
    opts = p.parse_args(argv)
    reuse = [a for a in opts.reuse.split(",") if a]
    if set(reuse) - set(ARMS):
        p.error(f"--reuse: unknown arm(s) {sorted(set(reuse) - set(ARMS))}; the arms are {', '.join(ARMS)}")
    if opts.sglang_steps == 0 and {"sglang-april", "sglang-sync"} & set(reuse):
        p.error("--reuse names an SGLang arm but --sglang-steps is 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts.work, opts.out = os.path.abspath(opts.work), os.path.abspath(opts.out)
    steps = opts.steps or int(_quickstart_default("STEPS"))
    t0 = time.monotonic()
    res = {"date": time.strftime("%Y-%m-%d"), "box": f"{os.cpu_count()} CPU cores, {_mem_gib():.0f} GiB",
           "load_start": load(), "command": " ".join(["python", "benchmarks/real_model.py", *sys.argv[1:]]),
           "extra_train_args": extra, "runs": {}, "ratios": {}}
    print(f"real-model benchmark: {steps} steps per embedded run, {opts.sglang_steps} per SGLang run; load {load()}", flush=True)
    interval = int(_quickstart_default("EVAL_INTERVAL"))
    for name, mode in (("april", []), ("sync", ["--no-partial"])):
        res["runs"][name] = (reused_stats(opts, name, steps) if name in reuse else
                             run_quickstart(opts, name, mode, steps, min(interval, steps), extra))
    res["april_minus_sync"] = april_vs_sync_final(res["runs"]["april"]["run_dir"], res["runs"]["sync"]["run_dir"])
    if opts.sglang_steps:
        for name, mode in (("sglang-april", []), ("sglang-sync", ["--no-partial"])):
            res["runs"][name] = (reused_stats(opts, name, opts.sglang_steps) if name in reuse else
                                 run_quickstart(opts, name, mode, opts.sglang_steps, 0,
                                                [*extra, "--rollout-backend", "sglang"]))
    for backend, (a, s) in {"embedded": ("april", "sync"), "SGLang's server": ("sglang-april", "sglang-sync")}.items():
        if a in res["runs"]:
            ra, rs = res["runs"][a], res["runs"][s]
            res["ratios"][backend] = {k: ra[k] / rs[k] if rs[k] else float("nan")
                                      for k in ("samples_per_s", "rollout_tokens_per_s")}
    if not opts.no_calibrate:
        res["engine"] = calibrate(opts)
        april_dir = res["runs"]["april"]["run_dir"]
        res["simulated_cpu"] = simulate_modes(april_dir, EngineCostModel.load(res["engine"]["path"]))
        res["simulated_gpu"] = simulate_modes(april_dir, gpu_cost_model("h100", "smollm2-135m"))
    plot_curves({k: v for k, v in res["runs"].items() if not k.startswith("sglang")}, os.path.join(opts.out, "eval_curves.png"))
    res["reading"] = reading(res)
    res["seconds"], res["load_end"] = round(time.monotonic() - t0, 1), load()
    md = markdown(res)
    with open(os.path.join(opts.out, "real_model.md"), "w") as f:
        f.write(md)
    with open(os.path.join(opts.out, "real_model.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(md)
    print(f"real-model benchmark took {res['seconds'] / 60:.1f} min; wrote {opts.out}/real_model.md, real_model.json, "
          "eval_curves.png")
    return 0


def _quickstart_default(var: str) -> str:
    """A setting's default as scripts/quickstart_real_model.sh writes it (`VAR=${VAR:-default}`): one place."""
    for line in open(os.path.join(REPO, "scripts", "quickstart_real_model.sh")):
        if line.startswith(f"{var}=${{{var}:-"):
            return line.split(":-", 1)[1].split("}", 1)[0]
    raise RuntimeError(f"scripts/quickstart_real_model.sh sets no default for {var}")


def _mem_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


if __name__ == "__main__":
    sys.exit(main())
