"""Pictures of a run: `python tools/plot_run.py RUN_DIR` writes PNGs into RUN_DIR/plots/.

- reward.png: rollout reward and eval accuracy over steps;
- throughput.png: rollout tokens/s over steps (and the over-sampling size, when it varies: auto);
- off_policy.png: off-policy token ratio over steps, and each step's staleness histogram (share of
  trained tokens per lag in policy versions);
- lengths.png: the response-length distribution (every finished sample's final length) and, per step, the
  trained lengths beside a synchronous run's on the same prompts (length bias: docs/metrics.md);
- occupancy.png: requests in flight over one rollout step, this run beside its sync / APRIL
  sibling when it exists (runs/quickstart-april <-> runs/quickstart-sync, or --compare DIR);
- tools.png (multi-turn runs, --agent-env): the tool-call rate (model turns that ended with a call) and tool
  calls per trajectory over steps, in rollouts and evals, beside eval accuracy;
- simulator.png: the rollout simulator's tokens/s beside the measured ones, per step (needs a cost
  model: --cost, or RUN_DIR/cost_model.json written by `tools/simulate_rollout.py calibrate`; runs
  with `--over-sampling-batch-size auto` also carry the planner's own per-step prediction).

Reads metrics.jsonl and rollout_trace.jsonl; matplotlib with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slime.rollout.simulator.from_run import predict_run  # noqa: E402
from slime.rollout.simulator.gpu_presets import cost_model_from_spec  # noqa: E402
from slime.rollout.simulator.lengths import read_trace  # noqa: E402
from slime.utils.metrics import read_metrics  # noqa: E402

logger = logging.getLogger("plot_run")
SIBLINGS = (("-april", "-sync"), ("-sync", "-april"))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_reward(rows, out) -> str | None:
    xs, ys = _series([r for r in rows if r["step"] >= 0], "reward/mean")
    ex, ey = _series(rows, "eval/accuracy")
    if not xs and not ex:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if xs:
        ax.plot(xs, ys, lw=1, alpha=0.5, label="rollout reward (per step)")
        k = max(1, len(ys) // 10)
        smooth = [sum(ys[max(0, i - k + 1): i + 1]) / len(ys[max(0, i - k + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, lw=2, label=f"rollout reward ({k}-step mean)")
    if ex:
        ax.plot(ex, ey, "o-", lw=2, label="eval accuracy")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("reward and eval accuracy")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, os.path.join(out, "reward.png"))


def plot_tools(rows, out) -> str | None:
    """Tool use of a multi-turn run: rollout/tool/* and eval/<set>/tool/* metrics, with eval accuracy."""
    rx, rate = _series([r for r in rows if r["step"] >= 0], "rollout/tool/call_rate")
    if not rx:
        return None
    _, per_sample = _series([r for r in rows if r["step"] >= 0], "rollout/tool/calls_per_sample_mean")
    evals = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/tool/call_rate")})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(rx, rate, lw=1.5, label="rollout tool-call rate")
    for name in evals:
        ex, ey = _series(rows, f"eval/{name}/tool/call_rate")
        left.plot(ex, ey, "s--", lw=1.5, label=f"eval {name} tool-call rate")
    ax, ay = _series(rows, "eval/accuracy")
    if ax:
        left.plot(ax, ay, "o-", lw=2, label="eval accuracy")
    left.set_ylim(-0.02, 1.02)
    left.set_xlabel("rollout step")
    left.set_title("tool-call rate (model turns ending in a call) and accuracy")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.plot(rx, per_sample, lw=1.5, label="rollout")
    for name in evals:
        ex, ey = _series(rows, f"eval/{name}/tool/calls_per_sample_mean")
        right.plot(ex, ey, "s--", lw=1.5, label=f"eval {name}")
    right.set_xlabel("rollout step")
    right.set_title("tool calls per trajectory")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    return _save(fig, os.path.join(out, "tools.png"))


def plot_throughput(rows, out) -> str | None:
    xs, ys = _series(rows, "rollout/tokens_per_s")
    if not xs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, lw=1.5, label="rollout tokens/s")
    ax.set_xlabel("rollout step")
    ax.set_ylabel("new tokens per second of rollout")
    ax.grid(alpha=0.3)
    ox, oy = _series(rows, "rollout/over_sampling_batch_size")
    if oy and len(set(oy)) > 1:
        ax2 = ax.twinx()
        ax2.step(ox, oy, where="post", color="tab:orange", label="over-sampling size (auto)")
        ax2.set_ylabel("groups per chunk")
        ax2.legend(loc="upper right")
    ax.set_title("rollout throughput")
    ax.legend(loc="upper left")
    return _save(fig, os.path.join(out, "throughput.png"))


# staleness bands for the histogram: a long run's lags reach tens of versions, one colour each would be unreadable
LAG_BANDS = ((0, 0), (1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, None))


def lag_bands(lags: list[int]) -> list[tuple[str, list[int]]]:
    """The bands of LAG_BANDS that hold any of `lags`, each with its label and the lags it holds."""
    out = []
    for lo, hi in LAG_BANDS:
        held = [g for g in lags if g >= lo and (hi is None or g <= hi)]
        if held:
            label = f"{lo}" if lo == hi else (f"{lo}+" if hi is None else f"{lo}-{hi}")
            out.append((label, held))
    return out


def plot_off_policy(rows, out) -> str | None:
    steps = [r for r in rows if r["step"] >= 0 and "rollout/off_policy_token_ratio" in r]
    if not steps:
        return None
    lags = sorted({int(k.rsplit("_", 1)[1]) for r in steps for k in r if k.startswith("rollout/staleness_hist/lag_")})
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    a1.plot([r["step"] for r in steps], [r["rollout/off_policy_token_ratio"] for r in steps], lw=1.5)
    a1.set_ylabel("off-policy token ratio")
    a1.set_ylim(0, 1)
    a1.grid(alpha=0.3)
    a1.set_title("off-policy tokens and staleness")
    tot = [sum(v for k, v in r.items() if k.startswith("rollout/staleness_hist/")) or 1 for r in steps]
    bands = lag_bands(lags)
    colours = plt.get_cmap("viridis")
    bottom = [0.0] * len(steps)
    for i, (label, held) in enumerate(bands):
        share = [sum(r.get(f"rollout/staleness_hist/lag_{g}", 0.0) for g in held) / t for r, t in zip(steps, tot)]
        a2.bar([r["step"] for r in steps], share, bottom=bottom, width=1.0, label=label,
               color=colours(i / max(1, len(bands) - 1)))
        bottom = [b + s for b, s in zip(bottom, share)]
    a2.set_ylabel("share of trained tokens")
    a2.set_xlabel("rollout step")
    a2.set_ylim(0, 1)
    a2.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), title="lag (versions)", title_fontsize=8)
    return _save(fig, os.path.join(out, "off_policy.png"))


def plot_lengths(trace, rows, out) -> str | None:
    lengths = [x for r in trace for g in r.get("finished_lengths", []) for x in g]
    bias = _series(rows, "length/trained_mean")[0]
    if bias:
        fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4))
        plot_length_bias(rows, right)
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    if lengths:
        ax.hist(lengths, bins=min(60, max(10, len(set(lengths)))), color="tab:green", alpha=0.8)
        ax.set_xlabel("response length (tokens)")
        ax.set_ylabel("samples")
        unf = trace[-1].get("unfinished_lengths", []) if trace else []
        ax.set_title(f"response lengths: {len(lengths)} finished samples (mean {sum(lengths) / len(lengths):.1f}, "
                     f"max {max(lengths)});\n{len(unf)} unfinished at the end", fontsize=10)
    else:
        xs, ys = _series(rows, "rollout/response_len_mean")
        if not xs:
            plt.close(fig)
            return None
        ax.plot(xs, ys)
        ax.set_xlabel("rollout step")
        ax.set_ylabel("mean response length")
        ax.set_title("response length (the trace has no per-sample lengths)")
    ax.grid(alpha=0.3)
    return _save(fig, os.path.join(out, "lengths.png"))


def plot_length_bias(rows, ax) -> None:
    """Per step, the trained response lengths beside a synchronous run's on the same prompts (mean, p90), and the
    share of that run's longest decile reaching training (slime/rollout/length_bias.py)."""
    for key, style, label in (("trained_mean", "-", "trained, mean"), ("sync_mean", "--", "synchronous, mean"),
                              ("trained_p90", "-", "trained, p90"), ("sync_p90", "--", "synchronous, p90")):
        xs, ys = _series(rows, f"length/{key}")
        if xs:
            ax.plot(xs, ys, style, lw=1.5, color="tab:blue" if "mean" in key else "tab:purple", label=label)
    ax.set_xlabel("rollout step")
    ax.set_ylabel("response length (tokens)")
    ax.grid(alpha=0.3)
    xs, ys = _series(rows, "length/longest_decile_share")
    if xs:
        ax2 = ax.twinx()
        ax2.plot(xs, ys, ":", color="tab:red", lw=1.5, label="longest decile reaching training")
        ax2.set_ylim(0, max(1.2, max(ys)))
        ax2.set_ylabel("share (1: as a synchronous run)")
        ax2.legend(loc="upper right", fontsize=8)
    ax.set_title("length bias: what trained vs a synchronous run on the same prompts", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def _typical_step(trace: list[dict]) -> dict | None:
    recs = [r for r in trace if r.get("occupancy")]
    if not recs:
        return None
    recs = recs[min(2, len(recs) - 1):] or recs  # past the first steps (empty buffer)
    return sorted(recs, key=lambda r: r.get("step_time_s", 0.0))[len(recs) // 2]


def plot_occupancy(run_dir, trace, out, compare: str | None) -> str | None:
    runs = [(os.path.basename(os.path.normpath(run_dir)), trace)]
    if compare and os.path.isfile(os.path.join(compare, "rollout_trace.jsonl")):
        runs.append((os.path.basename(os.path.normpath(compare)), read_trace(compare)))
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for name, tr in runs:
        rec = _typical_step(tr)
        if rec is None:
            continue
        pts = rec["occupancy"]
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post",
                label=f"{name} (step {rec['rollout_id']}, {rec.get('step_time_s', 0):.2f}s, {rec.get('new_tokens', 0)} tok)")
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("seconds into the rollout step")
    ax.set_ylabel("requests in flight")
    ax.set_title("engine occupancy over one rollout (a median-length step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, os.path.join(out, "occupancy.png"))


def plot_simulator(run_dir, rows, out, cost_spec: str | None) -> str | None:
    fig, ax = plt.subplots(figsize=(7, 4))
    xs, ys = _series(rows, "rollout/tokens_per_s")
    ax.plot(xs, ys, lw=1.5, label="measured")
    drawn = False
    px, py = _series(rows, "rollout/over_sampling_predicted_tokens_per_s")
    if px:
        ax.plot(px, py, "--", lw=1.5, label="auto planner's prediction for the size it chose")
        drawn = True
    if cost_spec:
        res = predict_run(run_dir, cost_model_from_spec(cost_spec))
        sim = res["simulated_tokens_per_s"]
        ax.plot(list(range(len(sim))), sim, lw=1.5, label=f"simulated ({res['cost']})")
        w = res["config"].warmup_steps
        ax.axhline(res["measured_mean_tokens_per_s"], color="tab:blue", ls=":", lw=1)
        ax.axhline(res["simulated_mean_tokens_per_s"], color="tab:green", ls=":", lw=1)
        err = res["simulated_mean_tokens_per_s"] / res["measured_mean_tokens_per_s"] - 1 if res["measured_mean_tokens_per_s"] else 0.0
        ax.set_title(f"simulator vs measurement: mean over steps >= {w}: measured {res['measured_mean_tokens_per_s']:.0f}, "
                     f"simulated {res['simulated_mean_tokens_per_s']:.0f} tok/s ({100 * err:+.0f}%)", fontsize=9)
        with open(os.path.join(out, "simulator.json"), "w") as f:
            json.dump({k: v for k, v in res.items() if k not in ("config", "result")} | {"config": str(res["config"])}, f,
                      indent=1, default=str)
        drawn = True
    if not drawn:
        plt.close(fig)
        logger.info("simulator.png skipped: no cost model (--cost, or RUN_DIR/cost_model.json) and no auto predictions")
        return None
    ax.set_xlabel("rollout step")
    ax.set_ylabel("rollout tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, os.path.join(out, "simulator.png"))


def sibling(run_dir: str) -> str | None:
    d = os.path.normpath(run_dir)
    for a, b in SIBLINGS:
        if d.endswith(a):
            other = d[: -len(a)] + b
            if os.path.isfile(os.path.join(other, "rollout_trace.jsonl")):
                return other
    return None


def plot_run(run_dir: str, cost: str | None = None, compare: str | None = None) -> list[str]:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise FileNotFoundError(f"{metrics}: not a run directory (no metrics.jsonl)")
    rows = read_metrics(metrics)
    try:
        trace = read_trace(run_dir)
    except FileNotFoundError:
        trace = []
    out = os.path.join(run_dir, "plots")
    os.makedirs(out, exist_ok=True)
    if cost is None and os.path.isfile(os.path.join(run_dir, "cost_model.json")):
        cost = os.path.join(run_dir, "cost_model.json")
    written = [plot_reward(rows, out), plot_tools(rows, out), plot_throughput(rows, out), plot_off_policy(rows, out),
               plot_lengths(trace, rows, out), plot_occupancy(run_dir, trace, out, compare or sibling(run_dir)),
               plot_simulator(run_dir, rows, out, cost if trace else None)]
    return [p for p in written if p]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--cost", default=None, help="cost model for simulator.png (default RUN_DIR/cost_model.json)")
    ap.add_argument("--compare", default=None, help="another run for occupancy.png (default: the sync/APRIL sibling)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    paths = plot_run(a.run_dir, a.cost, a.compare)
    print(f"plots written to {os.path.join(a.run_dir, 'plots')}: " + ", ".join(os.path.basename(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
