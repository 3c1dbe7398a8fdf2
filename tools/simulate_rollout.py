"""Predict rollout throughput before spending GPUs: the rollout simulator's command line.

    # measure an engine's costs (starts the embedded engine on a model dir, or probes a running server)
    python tools/simulate_rollout.py calibrate --model-path runs/tiny/model-sft --out cost.json
    # simulate modes on a workload (a calibration file or a modelled GPU; lengths from a run or parametric)
    python tools/simulate_rollout.py run --cost gpu:h100:qwen3-4b:tp2 --num-engines 4 \
        --rollout-batch-size 32 --n-samples-per-prompt 8 --over-sampling-batch-size 64 \
        --rollout-max-response-len 16384 --lengths lognormal:median=6000,sigma=0.8,corr=0.5,prompt=200 \
        --modes sync april pool stream
    python tools/simulate_rollout.py run --cost cost.json --lengths run:runs/quickstart-april ...
    # the APRIL paper's configuration (Qwen3-4B, DAPO-Math-17k-like lengths, 32 x 8, over-sampling 64, 8 H100s)
    python tools/simulate_rollout.py paper
    # a finished run: its own configuration and lengths, simulated beside what it measured
    python tools/simulate_rollout.py predict-run runs/quickstart-april --cost cost.json

Importable: `run_modes(...)`, `paper_reproduction(...)`, `parse_lengths(spec)`; the simulator itself
is `slime.rollout.simulator`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from slime.rollout.simulator import LogNormalLengths, ParetoLengths, SimConfig, lengths_from_run, simulate
from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.simulator.from_run import predict_run
from slime.rollout.simulator.lengths import PAPER_LENGTHS
from slime.rollout.simulator.gpu_presets import cost_model_from_spec, gpu_cost_model
from slime.rollout.staleness import StalenessCap

logger = logging.getLogger("simulate_rollout")

# The APRIL paper's configuration (arXiv 2509.18521; RLsys-Foundation/APRIL
# scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh): Qwen3-4B on DAPO-Math-17k, 8 GPUs
# colocated, SGLang engines of 2 GPUs (--rollout-num-gpus-per-engine 2), --sglang-mem-fraction-static 0.6,
# --rollout-batch-size 32 --n-samples-per-prompt 8 --over-sampling-batch-size 64, max response 16384.
PAPER = dict(gpu="h100", model="qwen3-4b", tp=2, engines=4, mem_fraction=0.6, batch=32, n=8, over_sampling=64,
             max_response_len=16384, concurrency=512)
# Our assumptions for the response lengths (the paper gives no distribution): PAPER_LENGTHS, in
# slime/rollout/simulator/lengths.py (log-normal, median 6000, sigma 0.8, half the log-variance shared in a group).
PAPER_RANGE = (0.17, 0.44)


def parse_lengths(spec: str, max_response_len: int):
    """lognormal:median=M,sigma=S[,corr=C][,prompt=P] | pareto:alpha=A,scale=K,cap=Q[,prompt=P] | run:RUN_DIR"""
    kind, _, rest = spec.partition(":")
    if kind == "run":
        return lengths_from_run(rest, cap=max_response_len)
    kv = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if not eq:
            raise ValueError(f"--lengths {spec!r}: expected key=value, got {part!r}")
        kv[k] = float(v)
    known = {"lognormal": {"median", "sigma", "corr", "prompt"}, "pareto": {"alpha", "scale", "cap", "prompt"}}
    if kind not in known:
        raise ValueError(f"--lengths {spec!r}: kind must be lognormal, pareto or run")
    if set(kv) - known[kind]:
        raise ValueError(f"--lengths {spec!r}: unknown keys {sorted(set(kv) - known[kind])} (known: {sorted(known[kind])})")
    if kind == "lognormal":
        if "median" not in kv or "sigma" not in kv:
            raise ValueError(f"--lengths {spec!r}: lognormal needs median= and sigma=")
        return LogNormalLengths(kv["median"], kv["sigma"], max_response_len, kv.get("corr", 0.0), int(kv.get("prompt", 128)))
    return ParetoLengths(kv.get("alpha", 1.0), int(kv.get("scale", 1)), int(kv.get("cap", 64)), int(kv.get("prompt", 6)))


def mode_config(mode: str, base: SimConfig, over_sampling: int | None, stream_pool_size: int | None = None) -> SimConfig:
    """A mode's config; the names are the real runs': sync and april (train.py with and without
    --partial-rollout), pool (--rollout-mode pool), stream (train_async.py --rollout-mode stream, whose
    pool defaults to one batch of requests: `stream_pool_size`)."""
    if mode == "sync":
        return base.replace(mode="chunked", partial_rollout=False, over_sampling_batch_size=None)
    if mode == "april":
        return base.replace(mode="chunked", partial_rollout=True, over_sampling_batch_size=over_sampling)
    if mode == "pool":
        return base.replace(mode="pool", partial_rollout=True)
    if mode == "stream":
        return base.replace(mode="stream", pool_size=stream_pool_size or base.pool_size)
    raise ValueError(f"unknown mode {mode!r} (sync, april, pool, stream)")


def run_modes(cost: EngineCostModel, lengths, base: SimConfig, modes: list[str], over_sampling: list[int],
              stream_pool_size: int | None = None) -> list[dict]:
    """Simulate every mode (APRIL once per over-sampling size); one summary dict each."""
    out = []
    for mode in modes:
        for os_size in (over_sampling if mode == "april" else [None]):
            out.append(simulate(mode_config(mode, base, os_size, stream_pool_size), cost, lengths).summary())
    return out


def print_table(rows: list[dict]) -> None:
    ref = next((r["tokens_per_s"] for r in rows if r["mode"] == "sync"), None)
    print(f"{'mode':16s} {'tok/s':>9s} {'/sync':>6s} {'e2e tok/s':>9s} {'goodput':>9s} {'idle':>5s} {'off-pol':>7s} "
          f"{'step s':>7s} {'samples/s':>9s} {'long10':>6s}  staleness (lag: share of trained tokens)")
    for r in rows:
        hist = r["staleness_hist"]
        tot = sum(hist.values()) or 1
        st = " ".join(f"{k}:{v / tot:.2f}" for k, v in list(hist.items())[:6])
        rel = f"{r['tokens_per_s'] / ref:6.2f}" if ref else "     -"
        share = "     -" if r["longest_decile_share"] is None else f"{r['longest_decile_share']:6.2f}"
        print(f"{r['mode']:16s} {r['tokens_per_s']:9.0f} {rel} {r['e2e_tokens_per_s']:9.0f} {r['goodput_tokens_per_s']:9.0f} "
              f"{r['engine_idle_fraction']:5.2f} {r['off_policy_token_ratio']:7.3f} {r['step_s']:7.1f} "
              f"{r['trained_samples_per_s']:9.1f} {share}  {st}")


def paper_reproduction(steps: int = 20, warmup: int = 4, seed: int = 0, verbose: bool = True, **length_overrides) -> dict:
    """Sync vs APRIL on the APRIL paper's configuration; prints the assumptions and the predicted gain."""
    p = PAPER
    lp = {**PAPER_LENGTHS, **length_overrides}
    cost = gpu_cost_model(p["gpu"], p["model"], tp=p["tp"], mem_fraction=p["mem_fraction"])
    lengths = LogNormalLengths(lp["median"], lp["sigma"], p["max_response_len"], lp["corr"], int(lp["prompt"]))
    base = SimConfig(rollout_batch_size=p["batch"], n_samples_per_prompt=p["n"], num_engines=p["engines"],
                     concurrency_per_engine=p["concurrency"], max_response_len=p["max_response_len"],
                     steps=steps, warmup_steps=warmup, seed=seed, top_ups=False)  # the paper's APRIL: whole chunks
    sync, april = run_modes(cost, lengths, base, ["sync", "april"], [p["over_sampling"]])
    gain = april["tokens_per_s"] / sync["tokens_per_s"] - 1.0
    out = {"assumptions": {"configuration": p, "lengths": lengths.describe(), "engine": cost.describe(),
                           "sources": cost.source},
           "sync": sync, "april": april, "gain": gain, "paper_range": PAPER_RANGE,
           "inside_paper_range": PAPER_RANGE[0] <= gain <= PAPER_RANGE[1]}
    if verbose:
        print("APRIL paper configuration (arXiv 2509.18521; the APRIL repository's run-qwen3-4B-dapo-partial.sh):")
        print(f"  Qwen3-4B, {p['engines']} SGLang engines x TP{p['tp']} on 8 H100s (colocated, mem fraction "
              f"{p['mem_fraction']}), rollout batch {p['batch']} x {p['n']}, over-sampling {p['over_sampling']}, "
              f"max response {p['max_response_len']}")
        print(f"  assumed engine: {cost.describe()}")
        print(f"  numbers from: {cost.source}")
        print(f"  assumed lengths (DAPO-Math-17k-like; the paper gives no distribution): {lengths.describe()}")
        print(f"  simulated {steps} steps from an empty buffer, the first {warmup} not counted; APRIL refills whole "
              f"chunks as in the paper (ours also tops up as requests finish)")
        print_table([sync, april])
        print(f"predicted APRIL rollout throughput gain: {100 * gain:+.1f}% (paper: +{100 * PAPER_RANGE[0]:.0f}% "
              f"to +{100 * PAPER_RANGE[1]:.0f}%) -> {'inside' if out['inside_paper_range'] else 'OUTSIDE'} the range")
    return out


def _sensitivity() -> None:
    print("\nsensitivity to the assumed lengths (median, sigma, within-group correlation):")
    for med, sig, corr in [(4096, 0.8, 0.5), (6000, 0.8, 0.5), (8000, 0.7, 0.5), (6000, 0.8, 0.0), (6000, 1.0, 0.5)]:
        r = paper_reproduction(verbose=False, median=med, sigma=sig, corr=corr)
        print(f"  median {med:5d} sigma {sig} corr {corr}: {r['assumptions']['lengths'].split('(')[1].split(')')[0]}; "
              f"gain {100 * r['gain']:+.1f}%, APRIL off-policy tokens {r['april']['off_policy_token_ratio']:.2f}")


def _calibrate(a) -> int:
    import asyncio

    from slime.rollout.simulator.calibrate import calibrate_async

    levels = tuple(int(x) for x in a.curve.split(",")) if a.curve else ()
    if a.url:
        if a.vocab is None:
            raise SystemExit("calibrate --url: give --vocab (the tokenizer's size) for random prompt ids")
        cost = asyncio.run(calibrate_async(a.url, a.vocab, passes=a.passes, curve_levels=levels, quick=a.quick))
    else:
        from transformers import AutoTokenizer

        from slime.backends.hf_engine.local_server import EngineServer

        vocab = len(AutoTokenizer.from_pretrained(a.model_path))
        server = EngineServer(a.model_path, ["--num-threads", str(a.num_threads)]).wait_healthy(300)
        try:
            cost = asyncio.run(calibrate_async(server.url, vocab, passes=a.passes, curve_levels=levels, quick=a.quick,
                                               name=f"embedded engine on {a.model_path}"))
        finally:
            server.stop()
    cost.save(a.out)
    print(cost.describe())
    print(f"decode fit rel. RMS {cost.extra['decode_fit_rel_rms']}; written to {a.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("calibrate", help="measure an engine's cost model")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="start the embedded engine on this model directory")
    src.add_argument("--url", help="a running engine (SGLang or embedded)")
    c.add_argument("--vocab", type=int, default=None, help="tokenizer size (with --url)")
    c.add_argument("--num-threads", type=int, default=1)
    c.add_argument("--passes", type=int, default=3)
    c.add_argument("--quick", action="store_true", help="five probes instead of ten, shorter bursts")
    c.add_argument("--curve", default="1,4,16,64", help="also measure tokens/s with this many requests in flight")
    c.add_argument("--out", required=True)
    r = sub.add_parser("run", help="simulate rollout modes")
    r.add_argument("--cost", required=True, help="calibration JSON or gpu:<gpu>:<model>:tp<N>")
    r.add_argument("--lengths", required=True, help=parse_lengths.__doc__)
    r.add_argument("--modes", nargs="+", default=["sync", "april", "pool"])
    r.add_argument("--rollout-batch-size", type=int, required=True)
    r.add_argument("--n-samples-per-prompt", type=int, default=8)
    r.add_argument("--over-sampling-batch-size", type=int, nargs="+", default=None, help="APRIL sizes (default 2x batch)")
    r.add_argument("--rollout-max-response-len", type=int, required=True)
    r.add_argument("--num-engines", type=int, default=1)
    r.add_argument("--sglang-server-concurrency", type=int, default=512)
    r.add_argument("--rollout-pool-size", type=int, default=None,
                   help="default: concurrency x engines (stream: one batch of requests, capped by that, as train_async.py)")
    r.add_argument("--pass-rate", type=float, default=1.0, help="share of finished groups the dynamic filter keeps")
    r.add_argument("--max-staleness", type=int, default=None)
    r.add_argument("--staleness-policy", choices=["restart", "mask", "keep"], default="restart")
    r.add_argument("--disable-length-guard", action="store_true", help="as train.py's")
    r.add_argument("--reuse-stale-kv", action="store_true")
    r.add_argument("--pause-mode", choices=["abort", "retract", "in_place"], default="in_place",
                   help="stream mode: how a push reaches the requests in flight (train_async.py's flag)")
    r.add_argument("--admission", choices=["auto", "fixed"], default="fixed",
                   help="pool and stream modes: fixed --rollout-pool-size, or auto (adjusted from the engines' loads, "
                        "at most the pool size)")
    r.add_argument("--train-time", type=float, default=0.0, help="seconds of training per step")
    r.add_argument("--max-async-lag", type=int, default=1, help="stream mode: train_async.py's flag")
    r.add_argument("--ignore-eos", action="store_true", help="every sample runs to its drawn length as its budget")
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--auto", action="store_true",
                   help="also print the size --over-sampling-batch-size auto would choose on this workload")
    r.add_argument("--json", action="store_true", help="print the summaries as JSON too")
    pp = sub.add_parser("paper", help="the APRIL paper's configuration: sync vs APRIL")
    pp.add_argument("--steps", type=int, default=20)
    pp.add_argument("--sensitivity", action="store_true", help="also vary the assumed lengths")
    pr = sub.add_parser("predict-run", help="a finished run, simulated beside its measurement")
    pr.add_argument("run_dir")
    pr.add_argument("--cost", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    if a.cmd == "calibrate":
        return _calibrate(a)
    if a.cmd == "paper":
        out = paper_reproduction(steps=a.steps)
        if a.sensitivity:
            _sensitivity()
        return 0 if out["inside_paper_range"] else 1
    if a.cmd == "predict-run":
        res = predict_run(a.run_dir, cost_model_from_spec(a.cost))
        print(f"{a.run_dir}: measured {res['measured_mean_tokens_per_s']:.0f} tok/s, simulated "
              f"{res['simulated_mean_tokens_per_s']:.0f} tok/s ({res['lengths']}; {res['cost']})")
        return 0
    cost = cost_model_from_spec(a.cost)
    lengths = parse_lengths(a.lengths, a.rollout_max_response_len)
    base = SimConfig(rollout_batch_size=a.rollout_batch_size, n_samples_per_prompt=a.n_samples_per_prompt,
                     num_engines=a.num_engines, concurrency_per_engine=a.sglang_server_concurrency,
                     pool_size=a.rollout_pool_size or a.sglang_server_concurrency * a.num_engines,
                     max_response_len=a.rollout_max_response_len, pass_rate=a.pass_rate, max_staleness=a.max_staleness,
                     staleness_policy=a.staleness_policy, reuse_stale_kv=a.reuse_stale_kv, pause_mode=a.pause_mode,
                     restart_budget=StalenessCap.from_args(a).restart_budget, admission=a.admission,
                     train_time_s=a.train_time,
                     max_async_lag=a.max_async_lag, budgets_are_lengths=a.ignore_eos, steps=a.steps,
                     warmup_steps=a.warmup, seed=a.seed)
    stream_pool = a.rollout_pool_size or min(a.rollout_batch_size * a.n_samples_per_prompt,
                                             a.sglang_server_concurrency * a.num_engines)
    rows = run_modes(cost, lengths, base, a.modes, a.over_sampling_batch_size or [2 * a.rollout_batch_size], stream_pool)
    print(f"engine: {cost.describe()}\nlengths: {lengths.describe()}")
    print_table(rows)
    if a.auto:
        from slime.rollout.simulator.planner import OverSamplingPlanner

        planner = OverSamplingPlanner(mode_config("april", base, a.rollout_batch_size), cost)
        info = planner.choose(lengths, a.pass_rate)
        print(f"auto would choose {planner.size()} groups per chunk (predicted goodput per candidate: "
              f"{planner.history[-1]['goodput']}; {info['rollout/over_sampling_plan_s']:.1f}s to plan)")
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
