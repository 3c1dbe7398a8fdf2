"""Per-turn metrics of multi-turn samples (`{prefix}tool/...`: turns, calls, tool time and failures, bad calls,
and the off-policy share of model tokens only). Samples without a record (single-turn) are left out."""

from __future__ import annotations

from collections import Counter

from slime.rollout.multi_turn.trajectory import KEY
from slime.utils.types import Sample


def tool_metrics(samples: list[Sample], prefix: str = "rollout/", train_version: int | None = None) -> dict[str, float]:
    recs = [(s, s.metadata[KEY]) for s in samples if isinstance(s.metadata, dict) and KEY in s.metadata]
    if not recs:
        return {}
    n = len(recs)
    turns = [sum(1 for t in r["turns"] if t["kind"] == "model") for _, r in recs]
    calls = [c for _, r in recs for c in r["calls"]]
    model_spans = [t["end"] - t["start"] for _, r in recs for t in r["turns"] if t["kind"] == "model"]
    obs_tokens = [sum(t["end"] - t["start"] for t in r["turns"] if t["kind"] == "tool") for _, r in recs]
    ran = [c for c in calls if c["state"] in ("done", "failed")]
    failed = Counter(c["name"] or "?" for c in calls if c["state"] == "failed")
    p = f"{prefix}tool/"
    out = {
        p + "samples": float(n),
        p + "turns_per_sample_mean": sum(turns) / n,
        p + "turns_per_sample_max": float(max(turns)),
        p + "calls_per_sample_mean": len(calls) / n,
        p + "samples_with_call_ratio": sum(1 for _, r in recs if r["calls"]) / n,
        # the tool-call rate: the share of model turns that ended by calling a tool
        p + "call_rate": len(calls) / sum(turns) if sum(turns) else 0.0,
        p + "time_s_total": sum(c["seconds"] for c in ran),
        p + "time_s_per_call_mean": sum(c["seconds"] for c in ran) / len(ran) if ran else 0.0,
        p + "failures": float(sum(failed.values())),
        p + "bad_calls": float(sum(1 for c in calls if c["state"] == "bad_call")),
        p + "reruns": float(sum(1 for c in calls if c["reran"])),
        p + "truncated_outputs": float(sum(1 for c in calls if c["truncated"])),
        p + "pending_calls": float(sum(1 for c in calls if c["state"] == "pending")),
        p + "model_tokens_per_turn_mean": sum(model_spans) / len(model_spans) if model_spans else 0.0,
        p + "observation_tokens_per_sample_mean": sum(obs_tokens) / n,
    }
    for name, k in failed.items():
        out[f"{p}failures/{name}"] = float(k)
    if train_version is not None:
        model_tokens = off = 0
        for s, r in recs:
            for t in r["turns"]:
                if t["kind"] == "model":
                    versions = s.weight_versions[t["start"]:t["end"]]
                    model_tokens += len(versions)
                    off += sum(1 for v in versions if v < train_version)
        out[p + "model_off_policy_token_ratio"] = off / model_tokens if model_tokens else 0.0
    return out
