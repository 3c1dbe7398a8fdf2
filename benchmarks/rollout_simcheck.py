"""The rollout benchmark's `--simulate`: the simulator's prediction of every mode beside the measurement.

The engine is calibrated in passes interleaved with the benchmark's rounds (before the first and
after each), so calibration and measurement see the same load of a shared machine; the fit uses
each probe's median. Each mode is then simulated with the same flags, the same number of steps and
the same workload (the benchmark's seeded budgets replayed group by group: the k-th fresh group
has the same lengths in both), from an empty buffer as the benchmark starts.
"""

from __future__ import annotations

from rollout_report import median
from rollout_workload import BudgetSource, workload_lengths

from slime.rollout.simulator import ReplayLengths, SimConfig, simulate
from slime.rollout.simulator.calibrate import Calibrator
from slime.rollout.simulator.gpu_presets import gpu_cost_model
from slime.rollout.simulator.lengths import read_trace

GPU_SCALE_TOKENS = 16384  # the workload's cap at GPU scale (a reasoning model's --rollout-max-response-len)


def make_calibrator(engines, vocab: int, args, quick: bool = False, max_context: int | None = None,
                    new_tokens: int = 64) -> Calibrator:
    """The modes' engine, timed through their router; the client's cost through the rollout's request path
    (`args`: the modes' flags), this driver's CPU time and the router's (pinned to the driver's CPU). `quick`: the
    calibration's quick probe set; `max_context`: the probes' longest context (the workload's, not the model's);
    `new_tokens`: tokens per probe row."""
    urls = engines.worker_urls()
    if len(urls) != 1:
        raise ValueError(f"--simulate calibrates one engine; the benchmark runs {len(urls)}")
    router = engines.router.process.pid if engines.router is not None and engines.router.process is not None else None
    return Calibrator(urls[0], vocab, client_url=engines.router_url, name="embedded engine (this benchmark)",
                      args=args, client_pids=[router] if router else [], quick=quick, max_context=max_context,
                      new_tokens=new_tokens)


def replay(opts, vocab: int, groups: int) -> ReplayLengths:
    """The budgets the modes' `BudgetSource(..., opts.seed, ...)` hands out, in order (every mode's uses this seed)."""
    src = BudgetSource(workload_lengths(opts.workload, opts.scale, opts.cap), opts.seed, opts.n, vocab)
    out = []
    for g in src.get_groups(groups):
        out.append((len(g[0].tokens), [s.metadata["max_response_len"] for s in g]))
    return ReplayLengths(out, opts.scale * opts.cap)


def sim_config(runner, b: int, c_star: int) -> SimConfig:
    a = runner.args
    return SimConfig(mode=a.rollout_mode, rollout_batch_size=b, n_samples_per_prompt=a.n_samples_per_prompt,
                     over_sampling_batch_size=int(a.over_sampling_batch_size), partial_rollout=a.partial_rollout,
                     pool_size=a.rollout_pool_size, concurrency_per_engine=c_star, num_engines=1,
                     max_response_len=a.rollout_max_response_len, reuse_stale_kv=a.reuse_stale_kv,
                     steps=runner.step, warmup_steps=runner.warmup_steps, budgets_are_lengths=True, seed=0)


def predict(runners: dict, res: dict, cal: Calibrator, opts, vocab: int, b: int, c_star: int,
            speed: dict | None = None, on_gpu: bool = False) -> dict:
    """{mode: {measured, predicted, error, ...}}; prints the table. `speed`: seconds of a fixed CPU probe on the
    engines' CPU around each calibration pass and each mode's slices: a mode's `box_speed_vs_calibration` > 1
    means the box ran that much slower while it ran than while calibrating (the wall clock is then not
    comparable). `on_gpu`: the engine thread's CPU share is not contention there (it waits for the device), so the
    contention-matched prediction and the CPU-time cost model are left out."""
    cost = cal.fit("median")
    speed = speed or {}
    cal_speed = median(speed["calibration"]) if speed.get("calibration") else None
    out, sim_occ = {}, {}
    print(f"\nsimulator ({cost.describe()}; decode fit rel. RMS {cost.extra['decode_fit_rel_rms']}, "
          f"{cost.extra['passes']} calibration passes; client: {cost.extra.get('client')}, driver CPU share "
          f"{cost.extra.get('driver_cpu_share')})")
    print(f"{'mode':8s} {'measured':>9s} {'simulated':>9s} {'error':>7s} {'off-pol':>7s} {'sim':>5s} "
          f"{'idle':>5s} {'steps':>5s}   engine decode: measured s, model on the measured steps, simulated s | prefill (the same)")
    for name, runner in runners.items():
        groups = runner.source.group_counter * 2 + 200
        result = simulate(sim_config(runner, b, c_star).replace(record_timeline=True), cost, replay(opts, vocab, groups))
        sim = result.summary()
        sim_occ[name] = _sim_occupancy(result)
        e, se = runner.engine, result.measured_engine_stats()  # both: the measured steps only
        st = result.engine_stats  # the whole run, warm-up included (as engine_total below)
        # what the engine did, over the whole run as the simulator counts it (the warm-up's steps too); the
        # embedded engine decodes rows in its prefill steps as well (one packed forward per step)
        et = runner.engine_total
        dec_steps = et.get("decode_steps", 0) + et.get("prefill_decode_steps", 0)
        dec_rows = et.get("decode_rows", 0) + et.get("prefill_decode_rows", 0)
        on_measured, pre_on_measured = cost.on_counters(e)
        measured = res[name]["tok_s"]
        http_cpu = round(e["process_cpu_s"] - e["thread_cpu_s"], 3) if "thread_cpu_s" in e else None
        err = sim["tokens_per_s"] / measured - 1.0
        out[name] = {"measured_tok_s": round(measured, 1), "sim_tok_s": round(sim["tokens_per_s"], 1),
                     "error": round(err, 4), "measured_off_policy": round(res[name]["off_policy"], 4),
                     "sim_off_policy": round(sim["off_policy_token_ratio"], 4),
                     "sim_engine_idle_fraction": round(sim["engine_idle_fraction"], 4), "steps": runner.step,
                     # what the engine did, whatever the wall clock: decode steps and rows per step
                     "measured_decode_steps": dec_steps, "sim_decode_steps": st["decode_steps"],
                     "measured_rows_per_step": round(dec_rows / max(1, dec_steps), 2),
                     "sim_rows_per_step": round(st["decode_rows"] / max(1, st["decode_steps"]), 2),
                     # the engine's HTTP side (its process's CPU beyond the scheduler thread's) over the measured steps
                     "measured_engine_http_cpu_s": http_cpu, "sim_engine_http_s": round(se["http_s"], 3),
                     "box_speed_vs_calibration": round(median(speed[name]) / cal_speed, 4)
                     if cal_speed and speed.get(name) else None,
                     "engine_cpu_share": round(e.get("decode_cpu_s", 0) / max(1e-9, e.get("decode_s", 0)), 4)
                     if "decode_cpu_s" in e else None}
        print(f"{name:8s} {measured:9.1f} {sim['tokens_per_s']:9.1f} {100 * err:+6.1f}% "
              f"{res[name]['off_policy']:7.3f} {sim['off_policy_token_ratio']:5.3f} {sim['engine_idle_fraction']:5.2f} "
              f"{runner.step:5d}   {e.get('decode_s', 0):.2f} ({e.get('decode_steps', 0)} steps x "
              f"{e.get('decode_rows', 0) / max(1, e.get('decode_steps', 0)):.1f}), {on_measured:.2f}, "
              f"{se['decode_s']:.2f} ({se['decode_steps']} x {se['decode_rows'] / max(1, se['decode_steps']):.1f}) | "
              f"{e.get('prefill_s', 0):.2f} ({e.get('prefills', 0)}), {pre_on_measured:.2f}, {se['prefill_s']:.2f} ({se['prefills']}) | idle "
              f"{e.get('idle_s', 0):.2f}, {sim['rollout_s'] - (se['prefill_s'] + se['decode_s'] + se['evict_s']):.2f} | "
              f"wall {res[name]['wall_s']:.2f}, {sim['rollout_s']:.2f} | to-target {res[name]['mean']['to_target_s']:.3f}, "
              f"{sim['time_to_target_s']:.3f} | engine HTTP {http_cpu} CPU s + scheduler admin {e.get('admin_s', 0):.2f} s, "
              f"{se['http_s']:.2f}")
    if cal_speed:
        print(f"the box's speed (a fixed CPU probe on the engines' CPU, median seconds; > 1 x: slower than while "
              f"calibrating): calibration {1e3 * cal_speed:.1f} ms; " + ", ".join(
                  f"{k} {out[k]['box_speed_vs_calibration']:.3f}x" for k in runners if out[k]["box_speed_vs_calibration"]))
    print("the steps' own bookkeeping (seconds per step, from each mode's trace): before the first request / after the "
          "drain; the simulator assumes " + f"{cost.step_overhead_s / 2:.3f} / {cost.step_overhead_s / 2:.3f}")
    for name, runner in runners.items():
        recs = read_trace(runner.args.run_dir)
        pre = [r["first_request_t"] for r in recs if r.get("first_request_t") is not None]
        post = [r["step_time_s"] - r["drained_t"] for r in recs if r.get("drained_t")]
        print(f"  {name:8s} {sum(pre) / max(1, len(pre)):.3f} / {sum(post) / max(1, len(post)):.3f}; requests in "
              f"flight (time-weighted mean, share of the step with none): measured {_occupancy(recs)}, simulated "
              f"{sim_occ[name]}")
    share_cal = None if on_gpu else cost.extra.get("engine_cpu_share")
    if share_cal:  # the same prediction at the CPU share the engine had while each mode ran
        print(f"contention-matched (engine CPU share while calibrating {share_cal:.2f}; a mode that ran at share s "
              f"is simulated with every cost x {share_cal:.2f}/s):")
        for name, runner in runners.items():
            e = runner.engine
            share = e.get("decode_cpu_s", 0) / max(1e-9, e.get("decode_s", 0))
            groups = runner.source.group_counter * 2 + 200
            sim = simulate(sim_config(runner, b, c_star), cost.scaled(share_cal / share), replay(opts, vocab, groups)).summary()
            err = sim["tokens_per_s"] / res[name]["tok_s"] - 1.0
            out[name].update(engine_cpu_share=round(share, 4), matched_sim_tok_s=round(sim["tokens_per_s"], 1),
                             matched_error=round(err, 4))
            print(f"  {name:8s} share {share:.2f}: simulated {sim['tokens_per_s']:9.1f} tok/s ({100 * err:+.1f}%)")
    try:
        cpu = None if on_gpu else cal.fit("median", clock="cpu")
    except RuntimeError:
        cpu = None
    if cpu is not None:  # the engine thread's CPU time: the cost model without the shared machine's contention
        print("engine CPU time (s): mode: decode measured / model on the measured steps | prefill measured / model")
        for name, runner in runners.items():
            e = runner.engine
            dec, pre = cpu.on_counters(e)
            print(f"  {name:8s} {e.get('decode_cpu_s', 0):.2f} / {dec:.2f} | {e.get('prefill_cpu_s', 0):.2f} / {pre:.2f}"
                  f"   (wall decode {e.get('decode_s', 0):.2f}: CPU share {e.get('decode_cpu_s', 0) / max(1e-9, e.get('decode_s', 0)):.2f})")
    out["cost_model"] = {k: v for k, v in cost.to_dict().items() if k != "extra"}
    out["calibration"] = {k: cost.extra.get(k) for k in ("passes", "probes", "prefill_probes", "decode_fit_rel_rms",
                                                         "prefill_fit_rel_rms", "host_fit_rel_rms")}
    out["gpu_scale"] = gpu_scale(runners, opts)
    return out


def _sim_occupancy(result) -> str:
    pts = result.client_timeline or []
    end = result.steps[-1]["t_end"] if result.steps else 0.0
    area = zero = 0.0
    for (t0, n), (t1, _) in zip(pts, pts[1:] + [(end, 0)]):
        area += n * (t1 - t0)
        zero += (t1 - t0) if n == 0 else 0.0
    zero += pts[0][0] if pts else 0.0
    return f"{area / end:.1f}, {zero / end:.2f}" if end else "-"


def _occupancy(recs: list[dict]) -> str:
    area = zero = total = 0.0
    for r in recs:
        pts = r.get("occupancy") or []
        for (t0, n), (t1, _) in zip(pts, pts[1:]):
            area += n * (t1 - t0)
            zero += (t1 - t0) if n == 0 else 0.0
        total += r["step_time_s"]
        zero += max(0.0, r["step_time_s"] - (pts[-1][0] if pts else 0.0)) + (pts[0][0] if pts else r["step_time_s"])
    return f"{area / total:.1f}, {zero / total:.2f}" if total else "-"


def gpu_scale(runners: dict, opts) -> dict:
    """The same modes and workload shape at GPU scale, in simulation: Qwen3-4B on one H100 (modelled from
    datasheets), budgets stretched to a 16K cap, 256 requests in flight (64 groups x 4)."""
    cost = gpu_cost_model("h100", "qwen3-4b", tp=1)
    scale = max(1, GPU_SCALE_TOKENS // opts.cap)
    lengths = workload_lengths(opts.workload, scale, opts.cap)
    lengths.prompt_len = 256
    res = {}
    for name, runner in runners.items():
        a = runner.args
        b = 64
        cfg = SimConfig(mode=a.rollout_mode, rollout_batch_size=b, n_samples_per_prompt=a.n_samples_per_prompt,
                        over_sampling_batch_size=b * int(a.over_sampling_batch_size) // a.rollout_batch_size,
                        partial_rollout=a.partial_rollout, pool_size=b * a.n_samples_per_prompt,
                        concurrency_per_engine=b * a.n_samples_per_prompt, max_response_len=scale * opts.cap,
                        reuse_stale_kv=a.reuse_stale_kv, steps=12, warmup_steps=3, budgets_are_lengths=True)
        res[name] = simulate(cfg, cost, lengths).summary()
    sync = res["sync"]["tokens_per_s"]
    print(f"GPU scale (simulated: {cost.name}; the {opts.workload} budgets x{scale}, max {scale * opts.cap}; 64 groups x "
          f"{runners['sync'].args.n_samples_per_prompt}, 256 in flight): " + "  ".join(
              f"{k} {v['tokens_per_s']:.0f} tok/s ({v['tokens_per_s'] / sync:.2f}x sync)" for k, v in res.items()))
    return {k: {"tok_s": round(v["tokens_per_s"], 1), "over_sync": round(v["tokens_per_s"] / sync, 3),
                "off_policy": round(v["off_policy_token_ratio"], 4)} for k, v in res.items()}


