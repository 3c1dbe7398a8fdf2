"""The rollout benchmark's report: the per-mode table, the engine breakdown and the JSON summary."""

from __future__ import annotations

import time


def median(xs):
    xs = sorted(xs)
    k = len(xs) // 2
    return xs[k] if len(xs) % 2 else 0.5 * (xs[k - 1] + xs[k])


def engine_breakdown(d: dict) -> str:
    busy = d.get("prefill_s", 0) + d.get("decode_s", 0) + d.get("evict_s", 0)
    steps = max(1, d.get("decode_steps", 0))
    return (f"engine: prefill {d.get('prefill_s', 0):.1f}s, decode {d.get('decode_s', 0):.1f}s, "
            f"evict {d.get('evict_s', 0):.1f}s, idle {d.get('idle_s', 0):.1f}s; {busy:.1f}s busy; "
            f"decode steps {d.get('decode_steps', 0)} x {d.get('decode_rows', 0) / steps:.1f} rows "
            f"({1000 * d.get('decode_s', 0) / steps:.2f} ms/step); prefills {d.get('prefills', 0)} "
            f"({d.get('prefill_rows', 0)} rows, {d.get('prefill_tokens', 0)} tok, {d.get('prefill_positions', 0)} padded); "
            f"per token: prefill {1e6 * d.get('prefill_s', 0) / max(1, d.get('prefill_tokens', 0)):.1f} us, "
            f"decode {1e6 * d.get('decode_s', 0) / max(1, d.get('decode_rows', 0)):.1f} us; "
            f"cache hits {d.get('cache_hits', 0)} ({d.get('cache_hit_tokens', 0)} tok not re-prefilled)")


def report(res: dict, limit: float, limit_rounds: list[float], limit_running: list[float], limit_wall: float,
           limit_engine: dict, c_star: int, curve: dict, rounds: int, started: float) -> dict:
    """Print the table and breakdowns; return the summary (the benchmark's last line, as JSON)."""
    print(f"\n{'mode':8s} {'tok/s':>8s} {'/sync':>6s} {'/limit':>6s} {'off-pol':>7s} {'steps':>5s} {'wall':>6s}  "
          f"per-step means: step, to-target, drain (abort->idle), outside, gap | requests, resumed, re-prefill tok, "
          f"new tok, engine running reqs")
    for k, r in res.items():
        mn = r["mean"]
        print(f"{k:8s} {r['tok_s']:8.1f} {r['tok_s'] / res['sync']['tok_s']:6.2f} {r['tok_s'] / limit:6.2f} "
              f"{r['off_policy']:7.3f} {r['steps']:5d} {r['wall_s']:5.1f}s  "
              f"{mn['step_s']:.3f}, {mn['to_target_s']:.3f}, {mn['drain_s']:.3f} ({mn['abort_to_idle_s']:.3f}), "
              f"{mn['outside_s']:.3f}, {mn['gap_s']:.3f} | {mn['requests']:.0f}, {mn['resumed_samples']:.0f}, "
              f"{mn['reprefill_tokens']:.0f}, {mn['new_tokens']:.0f}, {mn['occupancy']:.1f}")
    print(f"limit    {limit:8.1f}  (C* = {c_star} in flight, {limit_wall:.1f}s, engine running reqs "
          f"{sum(limit_running) / len(limit_running):.1f})   total benchmark "
          f"{time.monotonic() - started:.0f}s")
    for k, r in res.items():
        print(f"{k:8s} {engine_breakdown(r['engine'])}")
    print(f"limit    {engine_breakdown(limit_engine)}")
    per_round = {f"{k}_over_limit_rounds": [round(x / y, 3) for x, y in zip(v["rounds"], limit_rounds)]
                 for k, v in res.items() if k != "sync"}
    per_round["april_over_sync_rounds"] = [round(x / y, 3) for x, y in zip(res["april"]["rounds"],
                                                                            res["sync"]["rounds"])]
    summary = {
        "c_star": c_star, "curve": {str(c): round(v, 1) for c, v in curve.items()},
        "sync_tok_s": round(res["sync"]["tok_s"], 1), "april_tok_s": round(res["april"]["tok_s"], 1),
        "pool_tok_s": round(res["pool"]["tok_s"], 1), "limit_tok_s": round(limit, 1),
        "april_over_sync": round(res["april"]["tok_s"] / res["sync"]["tok_s"], 3),
        "april_over_limit": round(res["april"]["tok_s"] / limit, 3),
        "pool_over_limit": round(res["pool"]["tok_s"] / limit, 3),
        "off_policy_token_ratio": round(res["april"]["off_policy"], 4),
        "pool_off_policy_token_ratio": round(res["pool"]["off_policy"], 4),
        "rounds": rounds, **per_round,
        "median_april_over_limit": round(median(per_round["april_over_limit_rounds"]), 3),
        "median_pool_over_limit": round(median(per_round["pool_over_limit_rounds"]), 3),
        "median_april_over_sync": round(median(per_round["april_over_sync_rounds"]), 3),
        "targets_met": {
            "april_over_limit>=0.8": res["april"]["tok_s"] / limit >= 0.8,
            "april_over_sync>=1.5": res["april"]["tok_s"] / res["sync"]["tok_s"] >= 1.5,
            "pool_over_limit>=0.9": res["pool"]["tok_s"] / limit >= 0.9,
        },
    }
    if "april_kv" in res:  # --reuse-stale-kv: resumed on the KV they had, not re-prefilled
        for k in ("april_kv", "pool_kv"):
            summary[f"{k}_tok_s"] = round(res[k]["tok_s"], 1)
            summary[f"{k}_over_limit"] = round(res[k]["tok_s"] / limit, 3)
            summary[f"median_{k}_over_limit"] = round(median(per_round[f"{k}_over_limit_rounds"]), 3)
        summary["april_kv_over_sync"] = round(res["april_kv"]["tok_s"] / res["sync"]["tok_s"], 3)
        summary["targets_met_reuse_stale_kv"] = {
            "april_over_limit>=0.8": res["april_kv"]["tok_s"] / limit >= 0.8,
            "april_over_sync>=1.5": res["april_kv"]["tok_s"] / res["sync"]["tok_s"] >= 1.5,
            "pool_over_limit>=0.9": res["pool_kv"]["tok_s"] / limit >= 0.9,
        }
    return summary
