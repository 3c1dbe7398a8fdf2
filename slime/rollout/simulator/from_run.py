"""The simulator on a finished run: its configuration and workload from `rollout_trace.jsonl`, its
prediction beside what the run measured (used by `tools/plot_run.py` and `tools/simulate_rollout.py`)."""

from __future__ import annotations

from collections import Counter

from slime.rollout.simulator.cost_model import EngineCostModel
from slime.rollout.simulator.lengths import lengths_from_run, read_trace
from slime.rollout.simulator.simulate import SimConfig, simulate

EXCLUDED_REASONS = ("stale_ready", "reward_unsettled")


def run_config(records: list[dict], warmup_steps: int = 2) -> SimConfig:
    """The simulated configuration of a traced run (its most common over-sampling size under auto)."""
    recs = [r for r in records if "target" in r]
    if not recs:
        raise ValueError("rollout trace has no step records with the workload fields (the run predates them)")
    last = recs[-1]
    engines = int(last.get("num_engines") or 1)
    cap = int(last["in_flight_cap"])
    sizes = Counter(r["over_sampling_batch_size"] for r in recs if r.get("over_sampling_batch_size"))
    passed = sum(len(r["accepted"]) for r in recs)
    rejected = sum(1 for r in recs for reason in r.get("rejected", {}).values() if reason not in EXCLUDED_REASONS)
    return SimConfig(
        mode=last["mode"], rollout_batch_size=int(last["target"]), n_samples_per_prompt=int(last["n_samples_per_prompt"]),
        over_sampling_batch_size=sizes.most_common(1)[0][0] if sizes else None, partial_rollout=bool(last["partial_rollout"]),
        pool_size=cap, concurrency_per_engine=max(1, cap // engines), num_engines=engines,
        max_response_len=int(last["max_response_len"]), pass_rate=max(1e-3, (passed + 1) / (passed + rejected + 1)),
        steps=len(recs), warmup_steps=min(warmup_steps, max(0, len(recs) - 1)),
        budgets_are_lengths=bool(last.get("ignore_eos")), record_timeline=True)


def bookkeeping_s(records: list[dict]) -> float | None:
    """The median time a run's step spent outside generation (before its first request, after its drain)."""
    xs = sorted(r["first_request_t"] + r["step_time_s"] - r["drained_t"] for r in records
                if r.get("first_request_t") is not None and r.get("drained_t"))
    return xs[len(xs) // 2] if xs else None


def predict_run(run_dir: str, cost: EngineCostModel) -> dict:
    """Measured and simulated tokens/s of a run (per step and over the steps after the warm-up). The
    step's bookkeeping (not the engine's, not generation) is taken from the run's trace when it has it."""
    records = [r for r in read_trace(run_dir) if "target" in r]
    cfg = run_config(records)
    overhead = bookkeeping_s(records)
    if overhead is not None:
        cost = cost.replace(step_overhead_s=overhead)
    result = simulate(cfg, cost, lengths_from_run(run_dir))
    w = cfg.warmup_steps
    measured_new = sum(r["new_tokens"] for r in records[w:])
    measured_s = sum(r["step_time_s"] for r in records[w:])
    summary = result.summary()
    return {
        "config": cfg, "cost": cost.name, "lengths": result.lengths, "bookkeeping_s": overhead,
        "measured_tokens_per_s": [r["tokens_per_s"] for r in records],
        "simulated_tokens_per_s": [s["new_tokens"] / s["rollout_s"] if s["rollout_s"] else 0.0 for s in result.steps],
        "measured_mean_tokens_per_s": measured_new / measured_s if measured_s else 0.0,
        "simulated_mean_tokens_per_s": summary["tokens_per_s"],
        "simulated": summary, "result": result,
    }
