"""The rollout simulator on its own (no engine)."""

from __future__ import annotations

import json
import math
import os
import random
import sys

import pytest

from slime.rollout.simulator import (EngineCostModel, EmpiricalLengths, LogNormalLengths, ParetoLengths, ReplayLengths,
                                     SimConfig, kaplan_meier, lengths_from_run, simulate)
from slime.rollout.simulator.cost_model import nnls_fit
from slime.rollout.simulator.engine import EventLoop, SimEngine
from slime.rollout.simulator.gpu_presets import cost_model_from_spec, gpu_cost_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAT = EngineCostModel(decode_base_s=0.01, decode_per_seq_s=1e-5, prefill_per_token_s=1e-6, abort_s=0.01,
                       request_latency_s=0.001, step_overhead_s=0.0, name="flat")


def test_closed_form_jump_matches_step_by_step():
    eng = SimEngine(0, FLAT, EventLoop())
    rng = random.Random(0)
    for _ in range(300):
        alpha, beta, dt = rng.uniform(1e-4, 1e-2), rng.choice([0.0, rng.uniform(0, 1e-5)]), rng.uniform(0, 5.0)
        t, j = 0.0, 0
        while t + alpha + beta * j <= dt:
            t += alpha + beta * j
            j += 1
        assert eng._steps_within(alpha, beta, dt) == j
        assert math.isclose(eng._jump_time(alpha, beta, j), t, rel_tol=1e-9, abs_tol=1e-12)


def test_one_synchronous_batch_costs_what_the_model_says():
    cost = EngineCostModel(decode_base_s=0.002, decode_per_seq_s=0.001, decode_per_token_s=1e-6, prefill_base_s=0.003,
                           prefill_per_token_s=1e-4, abort_s=0.0, request_latency_s=0.0, step_overhead_s=0.0,
                           pad_slack_tokens=0)
    lens = [(10, [50, 50, 50, 50])]
    res = simulate(SimConfig(rollout_batch_size=1, n_samples_per_prompt=4, max_response_len=64, steps=1, warmup_steps=0),
                   cost, ReplayLengths(lens, 64))
    # one prefill of 4 x 10 tokens (first token each), then 49 decode steps of 4 rows whose contexts grow
    expect = 0.003 + 40 * 1e-4 + sum(0.002 + 4 * 0.001 + 1e-6 * 4 * (10 + j) for j in range(49))
    step = res.steps[0]
    assert step["new_tokens"] == 200
    assert step["rollout_s"] == pytest.approx(expect, rel=1e-9)
    assert res.engine_stats["decode_steps"] == 49 and res.engine_stats["decode_rows"] == 49 * 4


def test_mixed_prefill_chunks_prompts_into_decode_steps():
    """"mixed" (the embedded engine's paged cache)."""
    cost = EngineCostModel(decode_base_s=0.002, decode_per_seq_s=0.001, decode_per_token_s=1e-6, prefill_base_s=0.003,
                           prefill_per_token_s=1e-4, prefill_per_token2_s=1e-9, abort_s=0.0, request_latency_s=0.0,
                           step_overhead_s=0.0, prefill_mode="mixed", chunked_prefill_size=512, max_prefill_tokens=8192)
    res = simulate(SimConfig(rollout_batch_size=1, n_samples_per_prompt=4, max_response_len=64, steps=1, warmup_steps=0),
                   cost, ReplayLengths([(1000, [10, 10, 10, 10])], 64))
    # step 1: 4 chunks of 512 (keys 0..511); step 2: 4 x 488 at 512 (first token each); then 9 decode steps
    pairs1 = 4 * 512 * 513 / 2
    pairs2 = 4 * (488 * 512 + 488 * 489 / 2)
    expect = (2 * (0.002 + 0.003) + 1e-4 * 4000 + 1e-9 * (pairs1 + pairs2)
              + sum(0.002 + 4 * 0.001 + 1e-6 * 4 * (1000 + j) for j in range(9)))
    st = res.engine_stats
    assert res.steps[0]["new_tokens"] == 40
    assert st["prefills"] == 2 and st["prefill_tokens"] == 4000 and st["prefill_decode_steps"] == 0
    assert st["decode_steps"] == 9 and st["decode_rows"] == 36
    assert res.steps[0]["rollout_s"] == pytest.approx(expect, rel=1e-9)
    # a per-step budget below the prompts': rows fewest-left first, and decoding rows ride along with prefill
    tight = cost.replace(max_prefill_tokens=700)
    res = simulate(SimConfig(rollout_batch_size=1, n_samples_per_prompt=4, max_response_len=64, steps=1, warmup_steps=0),
                   tight, ReplayLengths([(1000, [10, 10, 10, 10])], 64))
    st = res.engine_stats
    assert st["prefill_tokens"] == 4000 and st["prefills"] == -(-4000 // 700)
    assert st["prefill_decode_steps"] > 0 and res.steps[0]["new_tokens"] == 40
    with pytest.raises(ValueError, match="prefill_mode"):
        cost.replace(prefill_mode="ragged")


def test_the_client_is_one_serial_resource():
    """Every request's send and reply cost the client in turn."""
    slow = FLAT.replace(client_per_request_s=0.01, client_per_input_token_s=1e-5, client_per_token_s=1e-4)
    cfg = SimConfig(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=64, steps=1, warmup_steps=0)
    lens = ReplayLengths([(10, [20] * 4)] * 8, 64)
    res = simulate(cfg, slow, lens)
    client = 16 * (0.01 + 1e-5 * 10 + 1e-4 * 20)
    assert res.steps[0]["rollout_s"] >= client
    assert res.steps[0]["rollout_s"] > simulate(cfg, FLAT, lens).steps[0]["rollout_s"] + 0.5 * client


def _long_tail(steps=10, **kw):
    base = dict(rollout_batch_size=8, n_samples_per_prompt=4, max_response_len=1024, steps=steps, warmup_steps=2,
                budgets_are_lengths=True)
    base.update(kw)
    return SimConfig(**base)


def test_april_beats_sync_on_a_long_tail_with_a_flat_decode_cost():
    lengths = ParetoLengths(alpha=1.0, scale=8, cap_steps=128)
    sync = simulate(_long_tail(), FLAT, lengths).summary()
    april = simulate(_long_tail(over_sampling_batch_size=16, partial_rollout=True), FLAT, lengths).summary()
    pool = simulate(_long_tail(mode="pool", partial_rollout=True, pool_size=32), FLAT, lengths).summary()
    assert april["tokens_per_s"] > 1.3 * sync["tokens_per_s"]
    assert pool["tokens_per_s"] > 1.3 * sync["tokens_per_s"]
    assert sync["off_policy_token_ratio"] == 0.0 and set(sync["staleness_hist"]) == {0}
    assert 0.0 < april["off_policy_token_ratio"] < 1.0 and max(april["staleness_hist"]) >= 1
    for s in (sync, april, pool):
        assert 0.0 <= s["engine_idle_fraction"] <= 1.0


def test_tokens_are_conserved_and_groups_are_never_lost():
    cfg = _long_tail(over_sampling_batch_size=24, partial_rollout=True, record_timeline=True)
    res = simulate(cfg, FLAT, ParetoLengths(1.0, 8, 128))
    for s in res.steps:
        assert s["accepted"] == cfg.rollout_batch_size
        assert s["trained_tokens"] <= sum(x["new_tokens"] for x in res.steps)
    # every token generated is either trained or still sits in a parked / finished-early group
    trained = sum(s["trained_tokens"] for s in res.steps)
    generated = sum(s["new_tokens"] for s in res.steps)
    assert trained <= generated and trained > 0.5 * generated
    # a chunk's worth of requests in flight; a top-up takes whole groups, so at most n - 1 more
    assert max(n for _, n in res.client_timeline) <= 24 * 4 + 3


def test_pool_mode_keeps_the_pool_full():
    res = simulate(_long_tail(mode="pool", partial_rollout=True, pool_size=20, record_timeline=True), FLAT,
                   ParetoLengths(1.0, 8, 128))
    assert max(n for _, n in res.client_timeline) == 20


def test_staleness_restart_wastes_tokens_and_a_filter_costs_groups():
    lengths = ParetoLengths(1.0, 8, 128)
    keep = simulate(_long_tail(over_sampling_batch_size=24, partial_rollout=True), FLAT, lengths).summary()
    restart = simulate(_long_tail(over_sampling_batch_size=24, partial_rollout=True, max_staleness=0,
                                  restart_budget=None), FLAT, lengths).summary()
    assert keep["goodput_tokens_per_s"] == pytest.approx(keep["e2e_tokens_per_s"])
    assert restart["wasted_tokens"] > 0 and restart["goodput_tokens_per_s"] < restart["e2e_tokens_per_s"]
    # unfinished samples older than the cap restart; finished members of parked groups stay (as in staleness.py)
    assert restart["off_policy_token_ratio"] < keep["off_policy_token_ratio"]
    filtered = simulate(_long_tail(pass_rate=0.5), FLAT, lengths)
    assert sum(s.get("rejected", 0) for s in filtered.steps) > 0
    assert filtered.summary()["goodput_tokens_per_s"] < filtered.summary()["e2e_tokens_per_s"]


def test_fully_async_mode_lags_and_respects_the_async_lag():
    lengths = ParetoLengths(1.0, 8, 128)
    fast = simulate(_long_tail(mode="stream", pool_size=32, train_time_s=0.05, max_async_lag=1), FLAT, lengths).summary()
    slow = simulate(_long_tail(mode="stream", pool_size=32, train_time_s=5.0, max_async_lag=1), FLAT, lengths).summary()
    assert fast["off_policy_token_ratio"] > 0.0
    assert slow["engine_idle_fraction"] > fast["engine_idle_fraction"]  # the rollout waits for a slow trainer


def test_stream_pause_modes_re_prefill_what_they_say():
    """A push while requests run (train_async.py's --pause-mode)."""
    lengths = ParetoLengths(1.0, 8, 128)
    cfg = _long_tail(mode="stream", pool_size=32, train_time_s=0.05, max_async_lag=1, steps=12)
    runs = {m: simulate(cfg.replace(pause_mode=m), FLAT, lengths) for m in ("abort", "retract", "in_place")}
    prefill = {m: r.measured_engine_stats()["prefill_tokens"] for m, r in runs.items()}
    assert prefill["in_place"] < prefill["retract"] and prefill["in_place"] < prefill["abort"]
    assert runs["retract"].engine_stats["retractions"] > 0 == runs["in_place"].engine_stats["retractions"]
    assert runs["abort"].summary()["requests_per_step"] > runs["in_place"].summary()["requests_per_step"]
    for r in runs.values():
        assert all(s["accepted"] == cfg.rollout_batch_size for s in r.steps)
        assert r.summary()["off_policy_token_ratio"] > 0.0
    assert runs["abort"].engine_stats["cache_hits"] == 0  # every resume came after an update: another version
    stale = simulate(cfg.replace(pause_mode="abort", reuse_stale_kv=True), FLAT, lengths)
    assert stale.engine_stats["cache_hits"] > 0


def test_optimistic_admission_retracts_when_the_cache_is_full():
    cost = FLAT.replace(kv_admission="optimistic", kv_capacity_tokens=800, optimistic_reserve_frac=0.0)
    res = simulate(_long_tail(steps=3, over_sampling_batch_size=16, partial_rollout=True), cost, ParetoLengths(1.0, 8, 128))
    assert res.engine_stats["retractions"] > 0
    assert all(s["accepted"] == 8 for s in res.steps)


def test_kaplan_meier_weights_censored_tails():
    plain = kaplan_meier([1, 2, 3, 4], [], cap=100)
    assert plain.mean() == pytest.approx(2.5)
    censored = kaplan_meier([1, 2, 3], [50], cap=100)  # one sample still running at 50: it ends beyond every finish
    assert censored.quantile(1.0) == 100 and censored.mean() == pytest.approx((1 + 2 + 3 + 100) / 4)
    early = kaplan_meier([10, 20, 30], [5], cap=100)  # censored early: removed from the risk set, no mass at the cap
    assert early.quantile(1.0) == 30
    assert sum(early.weights) == pytest.approx(1.0)


def test_lengths_from_a_run_trace(tmp_path):
    recs = [{"rollout_id": i, "target": 2, "finished_lengths": [[3, 5], [7, 9]], "unfinished_lengths": [40],
             "max_response_len": 64, "prompt_len": 6} for i in range(3)]
    (tmp_path / "rollout_trace.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    lengths = lengths_from_run(str(tmp_path))
    assert lengths.cap == 64 and lengths.quantile(1.0) == 64  # the last step's unfinished sample is censored at 40
    with pytest.raises(FileNotFoundError):
        lengths_from_run(str(tmp_path / "nope"))


def test_nnls_recovers_a_known_cost_and_never_goes_negative():
    rng = random.Random(1)
    rows = [[1.0, b, b * c] for b in (1, 4, 16, 64) for c in (10, 100, 1000)]
    truth = [2e-3, 5e-5, 1e-8]
    ys = [sum(t * x for t, x in zip(truth, r)) * rng.uniform(0.99, 1.01) for r in rows]
    coef, err = nnls_fit(rows, ys, ("a", "b", "c"))
    assert coef["a"] == pytest.approx(2e-3, rel=0.05) and coef["b"] == pytest.approx(5e-5, rel=0.1)
    assert err < 0.02
    coef, _ = nnls_fit([[1.0, 1.0], [1.0, 2.0]], [2.0, 1.0], ("a", "b"))  # slope would be negative
    assert coef["b"] == 0.0


def test_cost_model_io_and_errors(tmp_path):
    path = str(tmp_path / "c.json")
    FLAT.save(path)
    assert EngineCostModel.load(path) == FLAT
    (tmp_path / "bad.json").write_text(json.dumps({"decode_base_s": 1e-3, "decode_per_sek_s": 1}))
    with pytest.raises(ValueError, match="decode_per_sek_s"):
        EngineCostModel.load(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="kv_admission"):
        FLAT.replace(kv_admission="lazy")
    assert cost_model_from_spec(path) == FLAT
    with pytest.raises(ValueError, match="tp"):
        cost_model_from_spec("gpu:h100:qwen3-4b:2")


def test_gpu_preset_is_flat_in_batch_and_cheap_to_prefill():
    cost = gpu_cost_model("h100", "qwen3-4b", tp=2)
    assert cost.tokens_per_s(128, 500) / cost.tokens_per_s(1, 500) > 60  # a step costs ~ the same for 1 or 128 rows
    decode_per_token = cost.decode_step_s(64, 64 * 500, 64 * 500) / 64
    assert cost.prefill_per_token_s < decode_per_token / 5
    assert 400_000 < cost.kv_capacity_tokens < 800_000  # 2 x 80 GB x 0.6 minus 8 GB of weights, 144 KiB per token
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_cost_model("tpu")


def test_paper_reproduction_lands_in_the_papers_range(capsys):
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import simulate_rollout
    finally:
        sys.path.pop(0)
    out = simulate_rollout.paper_reproduction(steps=16, warmup=4)
    printed = capsys.readouterr().out
    assert 0.17 <= out["gain"] <= 0.44, out["gain"]
    for needle in ("Qwen3-4B", "over-sampling 64", "H100", "log-normal", "median 6000", "predicted APRIL rollout"):
        assert needle in printed


def test_lengths_specs_are_parsed_or_refused():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import simulate_rollout
    finally:
        sys.path.pop(0)
    ln = simulate_rollout.parse_lengths("lognormal:median=100,sigma=0.5,corr=0.2", 512)
    assert isinstance(ln, LogNormalLengths) and ln.cap == 512
    assert isinstance(simulate_rollout.parse_lengths("pareto:scale=4,cap=32", 512), ParetoLengths)
    with pytest.raises(ValueError, match="sigma"):
        simulate_rollout.parse_lengths("lognormal:median=100", 512)
    with pytest.raises(ValueError, match="unknown keys"):
        simulate_rollout.parse_lengths("pareto:alfa=1", 512)
    assert isinstance(EmpiricalLengths([[1, 2]], 8).sample_group(random.Random(0), 2)[1], list)


def test_a_paged_engine_pays_for_its_buckets():
    """With `paged_block_size` a mixed-length decode gathers less than B x longest but pays for its buckets."""
    base = EngineCostModel(decode_base_s=1e-3, decode_per_padded_s=1e-8, decode_per_bucket_s=1e-4)
    paged = base.replace(paged_block_size=32)
    same = [300] * 8
    spread = [4000] + [10] * 63
    assert base.decode_read(same) == (8 * 300, 0)
    assert paged.decode_read(same) == (8 * 320, 0)  # one bucket, whole blocks
    padded, extra = paged.decode_read(spread)
    assert extra == 1 and padded == 4000 // 32 * 32 + 32 + 63 * 32
    assert base.decode_read(spread) == (64 * 4000, 0)
    assert paged.decode_step_s(64, sum(spread), padded, extra) == pytest.approx(1e-3 + 1e-8 * padded + 1e-4)


def test_the_virtual_clock_jumps_and_keeps_equal_times_in_order():
    import asyncio

    from slime.rollout.simulator.clock import run_virtual

    async def main():
        loop = asyncio.get_running_loop()
        order = []
        for i in range(5):
            loop.call_at(10.0, order.append, i)
        await asyncio.sleep(3600)  # an hour of simulated time, at once
        t = loop.time()
        try:
            await asyncio.wait_for(asyncio.Event().wait(), 5)
        except TimeoutError:
            pass
        return order, t, loop.time()

    assert run_virtual(main()) == ([0, 1, 2, 3, 4], 3600.0, 3605.0)


def test_the_simulator_drives_the_real_step(monkeypatch):
    """The simulator drives the run's Rollout."""
    import slime.rollout.rollout as rollout_mod
    import slime.rollout.simulator.drive as drive

    seen = []
    real_step, real_take, real_update = rollout_mod.run_step, drive.StreamRollout.take, rollout_mod.Rollout.updating_weights

    async def counting_step(state, io, supply, placement, halt=None):
        seen.append((type(supply).__name__, type(placement).__name__))
        return await real_step(state, io, supply, placement, halt)

    async def counting_take(self, rollout_id, timeout):
        seen.append(("take", rollout_id))
        return await real_take(self, rollout_id, timeout)

    def counting_update(self, version):
        seen.append(("update", version, self.pause_mode))
        return real_update(self, version)

    monkeypatch.setattr(rollout_mod, "run_step", counting_step)
    monkeypatch.setattr(drive.StreamRollout, "take", counting_take)
    monkeypatch.setattr(rollout_mod.Rollout, "updating_weights", counting_update)
    lengths = ParetoLengths(1.0, 8, 128)
    simulate(_long_tail(steps=2, over_sampling_batch_size=16, partial_rollout=True), FLAT, lengths)
    simulate(_long_tail(steps=2, mode="pool", partial_rollout=True, pool_size=16), FLAT, lengths)
    assert seen == [("ChunkedSupply", "TargetPlacement"), ("update", 1, "abort"),
                    ("ChunkedSupply", "TargetPlacement")] + [("PoolSupply", "TargetPlacement"), ("update", 1, "abort"),
                                                             ("PoolSupply", "TargetPlacement")]
    seen.clear()
    simulate(_long_tail(steps=2, mode="stream", pool_size=16, train_time_s=0.05, pause_mode="retract"), FLAT, lengths)
    assert sorted(seen, key=str) == sorted([("PoolSupply", "StreamPlacement"), ("take", 0), ("take", 1),
                                            ("update", 1, "retract")], key=str)  # one segment


def test_a_simulated_mask_cap_keeps_stale_tokens_out_of_the_loss():
    """The real StalenessCap on simulated samples."""
    lengths = ParetoLengths(1.0, 8, 128)
    mask = simulate(_long_tail(over_sampling_batch_size=24, partial_rollout=True, max_staleness=0,
                               staleness_policy="mask"), FLAT, lengths)
    keep = simulate(_long_tail(over_sampling_batch_size=24, partial_rollout=True, max_staleness=0,
                               staleness_policy="keep"), FLAT, lengths)
    assert sum(s["staleness"]["mask"] for s in mask.steps) > 0 and mask.summary()["wasted_tokens"] > 0
    restart = simulate(_long_tail(over_sampling_batch_size=24, partial_rollout=True, max_staleness=0,
                                  restart_budget=None), FLAT, lengths)
    assert sum(s["staleness"]["keep"] for s in keep.steps) > 0 and keep.summary()["wasted_tokens"] == 0
    assert sum(s["stale_ready"] for s in restart.steps) > 0 and sum(s["stale_ready"] for s in mask.steps) == 0
    assert sum(s["staleness"]["stale_groups_at_train"] for s in mask.steps) > 0
    assert mask.summary()["off_policy_token_ratio"] < keep.summary()["off_policy_token_ratio"]


def test_a_simulation_runs_from_inside_a_running_event_loop():
    """The rollout benchmark calls the simulator from its own asyncio loop."""
    import asyncio

    async def main():
        return simulate(_long_tail(steps=2, over_sampling_batch_size=16, partial_rollout=True), FLAT,
                        ParetoLengths(1.0, 8, 128)).summary()

    assert asyncio.run(main())["tokens_per_s"] > 0


def test_the_simulator_pays_the_host_floor_on_a_shrinking_batch():
    """A synchronous step's tail costs the host's floor per step, not the device's tiny step."""
    lens = ReplayLengths([(8, [16] * 7 + [400])] * 3, 512)
    cfg = SimConfig(rollout_batch_size=1, n_samples_per_prompt=8, max_response_len=512, steps=3, warmup_steps=0)
    gpu_like = EngineCostModel(decode_base_s=0.002, decode_per_seq_s=1e-4, decode_per_token_s=2e-8, host_step_s=0.015,
                               host_per_row_s=2e-5, host_tail_s=3e-4, host_tail_per_row_s=1e-5, abort_s=0.0,
                               request_latency_s=0.0, step_overhead_s=0.0)
    with_host = simulate(cfg, gpu_like, lens).summary()
    plain = gpu_like.replace(host_step_s=0.0, host_per_row_s=0.0, host_tail_s=0.0, host_tail_per_row_s=0.0)
    without = simulate(cfg, plain, ReplayLengths([(8, [16] * 7 + [400])] * 3, 512)).summary()
    assert with_host["rollout_s"] > 3 * without["rollout_s"]
    per_step = with_host["rollout_s"] / 3
    assert per_step == pytest.approx(400 * (0.015 + 3e-4), rel=0.1)  # ~400 steps, each the host's 15.3 ms
