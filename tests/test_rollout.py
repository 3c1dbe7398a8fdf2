"""The run's Rollout (slime/rollout/rollout.py) on simulated engines (deterministic, a simulated clock)."""

from __future__ import annotations

import pytest

from slime.rollout.simulator import EngineCostModel, ParetoLengths, SimConfig, simulate
from slime.rollout.simulator.cluster import SimCluster

FLAT = EngineCostModel(decode_base_s=0.01, decode_per_seq_s=1e-5, prefill_per_token_s=1e-6, abort_s=0.01,
                       request_latency_s=0.001, step_overhead_s=0.0, name="flat")
LENGTHS = ParetoLengths(1.0, 8, 128)


def _config(**kw) -> SimConfig:
    return SimConfig(**{"rollout_batch_size": 8, "n_samples_per_prompt": 4, "max_response_len": 1024, "steps": 3,
                        "budgets_are_lengths": True, "pool_size": 16, "train_time_s": 0.05, "partial_rollout": True,
                        **kw})


@pytest.mark.parametrize("mode, pause, reuse, flush", [("chunked", "abort", False, True), ("chunked", "abort", True, False),
                                                       ("stream", "abort", False, True), ("stream", "retract", False, True),
                                                       ("stream", "in_place", False, False)])
def test_the_flush_rule_is_the_rollouts(mode, pause, reuse, flush, monkeypatch):
    """A push flushes the engines' prefix cache unless --reuse-stale-kv, or in place."""
    told = []
    real = SimCluster.update_weights if mode == "stream" else SimCluster.set_version
    monkeypatch.setattr(SimCluster, "update_weights" if mode == "stream" else "set_version",
                        lambda self, version, f: told.append(f) or real(self, version, f))
    simulate(_config(mode=mode, pause_mode=pause, reuse_stale_kv=reuse), FLAT, LENGTHS)
    assert told == [flush, flush]


def test_a_stream_push_aborts_requests_over_the_cap_by_rid(monkeypatch):
    """In place under --max-staleness with restart (the length guard off)."""
    aborted, real = [], SimCluster.abort_requests

    async def counting(self, rids, session=None):
        aborted.extend(rids)
        return await real(self, rids, session)

    monkeypatch.setattr(SimCluster, "abort_requests", counting)
    cfg = _config(steps=6, mode="stream", pool_size=32, pause_mode="in_place", max_staleness=0, restart_budget=None)
    res = simulate(cfg, FLAT, LENGTHS)
    assert aborted and all(s["accepted"] == cfg.rollout_batch_size for s in res.steps)
    aborted.clear()
    simulate(cfg.replace(staleness_policy="mask"), FLAT, LENGTHS)  # mask needs no restart: nothing to abort
    simulate(cfg.replace(restart_budget=0), FLAT, LENGTHS)  # nor the guard, which masks instead of restarting
    simulate(cfg.replace(max_staleness=None), FLAT, LENGTHS)
    assert aborted == []
