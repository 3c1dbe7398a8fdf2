"""The cost model's host terms (slime/rollout/simulator/host_fit.py)."""

from __future__ import annotations

import random

import pytest

from slime.rollout.simulator import EngineCostModel
from slime.rollout.simulator.host_fit import fit_host

# a GPU-like engine: the device's step grows with the batch, the host issues a step in 15 ms whatever its size
GPU_LIKE = EngineCostModel(decode_base_s=0.002, decode_per_seq_s=1e-4, decode_per_token_s=2e-8, host_step_s=0.015,
                           host_per_row_s=2e-5, host_tail_s=3e-4, host_tail_per_row_s=1e-5, abort_s=0.0,
                           request_latency_s=0.0, step_overhead_s=0.0, name="gpu-like")


def test_a_step_costs_the_larger_of_host_and_device_plus_the_tail():
    c = GPU_LIKE
    small = c.decode_step_s(1, 512, 512)  # launch-bound: the host's 15 ms floor
    assert small == pytest.approx(0.015 + 2e-5 + 3e-4 + 1e-5)
    big = c.decode_step_s(256, 256 * 512, 256 * 512)  # device-bound
    device = 0.002 + 256 * 1e-4 + 2e-8 * 256 * 512
    assert device > 0.015 + 256 * 2e-5 and big == pytest.approx(device + 3e-4 + 256 * 1e-5)
    # host-bound steps do not grow as contexts do; device-bound ones do
    assert c.decode_jump(1, 512, 512)[1] == 0.0 and c.decode_jump(256, 256 * 512, 256 * 512)[1] == pytest.approx(256 * 2e-8)
    # no host terms: the device terms alone (a model saved before them loads and prices steps as it did)
    plain = EngineCostModel.from_dict({k: v for k, v in c.to_dict().items() if not k.startswith("host_")})
    assert plain.decode_step_s(1, 512, 512) == pytest.approx(0.002 + 1e-4 + 2e-8 * 512)
    assert c.scaled(2.0).host_step_s == pytest.approx(0.030)
    # on summed counters: max of the sums, plus the tail
    dec, _ = c.on_counters({"decode_steps": 10, "decode_rows": 10, "decode_ctx_tokens": 5120, "decode_padded": 5120,
                            "decode_buckets": 10})
    assert dec == pytest.approx(10 * (0.015 + 2e-5) + 10 * (3e-4 + 1e-5))


def test_the_host_fit_recovers_the_terms_from_the_engines_counters():
    rng = random.Random(0)
    truth = {"host_step_s": 0.012, "host_per_row_s": 3e-5, "host_per_bucket_s": 4e-4, "host_tail_s": 2e-4,
             "host_tail_per_row_s": 8e-6}
    runs = []
    for rows in (1, 4, 16, 64, 128):
        for extra in (0, 2):
            steps = rng.randint(40, 80)
            x = [steps, steps * rows, steps * rows * 300, steps * rows * 320, steps * extra]
            noise = lambda: rng.uniform(0.99, 1.01)  # noqa: E731
            issue = (truth["host_step_s"] * steps + truth["host_per_row_s"] * x[1] + truth["host_per_bucket_s"] * x[4]) * noise()
            tail = (truth["host_tail_s"] * steps + truth["host_tail_per_row_s"] * x[1]) * noise()
            runs.append((issue, tail, x))
    terms, err = fit_host(runs)
    for k, v in truth.items():
        assert terms[k] == pytest.approx(v, rel=0.1), k
    assert err < 0.05
    assert fit_host(runs[:2]) == ({k: 0.0 for k in truth}, None)  # too few runs: no host terms


@pytest.mark.slow
def test_a_cpu_calibration_fits_host_terms_from_the_embedded_engines_counters(tmp_path):
    """On the CPU issuing a step is computing it."""
    import asyncio

    import aiohttp

    from slime.backends.hf_engine.local_server import EngineServer
    from slime.rollout.simulator.calibrate import Calibrator
    from slime.tasks.subtract_chain import VOCAB
    from slime.utils.tiny_model import build_preset, build_tokenizer

    model = build_preset("quickstart", str(tmp_path), build_tokenizer(VOCAB))
    srv = EngineServer(model, ["--seed", "0"], log_path=str(tmp_path / "engine.log")).wait_healthy(300)

    async def calibrate():
        cal = Calibrator(srv.url, len(VOCAB), quick=True, new_tokens=32)
        async with aiohttp.ClientSession() as session:
            await cal.measure(session)
        return cal

    try:
        cal = asyncio.run(calibrate())
    finally:
        srv.stop()
    cost = cal.fit()
    assert cost.host_step_s + cost.host_per_row_s > 0 and cost.host_tail_s + cost.host_tail_per_row_s > 0
    assert cost.extra["host_fit_rel_rms"] is not None
    runs = [r for p in cal.probes for r in p.host]
    issue, tail = sum(r[0] for r in runs), sum(r[1] for r in runs)
    assert 0 < tail < issue  # the CPU computes while it issues; the tail is bookkeeping
    # the fitted model (device terms and host terms) prices each probe's decode steps as the engine ran them
    from slime.rollout.simulator.cost_model import DECODE_TERMS

    errors = []
    for p in cal.probes:
        for (_, tail_s, x), (device_s, _) in zip(p.host, p.runs):
            device = sum(getattr(cost, k) * v for k, v in zip(DECODE_TERMS, x))
            errors.append(cost._host_on_sums(device, x[0], x[1], x[4]) / (device_s + tail_s) - 1)
    # median |error| 0.08 on a quiet 2-core box; 0.26 was seen at load ~10, where the probes' own times scatter
    assert sorted(abs(e) for e in errors)[len(errors) // 2] < 0.4, errors


def test_graph_decode_steps_are_priced_at_their_padded_shape():
    """With CUDA graphs (calibrated from an engine that runs them) a decode-only step gathers its padded shape."""
    from slime.backends.hf_engine.buckets import decode_shape

    c = EngineCostModel(decode_base_s=1e-3, paged_block_size=32, graph_max_rows=128)
    positions = [40, 100, 700]  # 3 rows -> 4; the longest reads 22 blocks -> 32
    assert c.decode_read(positions) == (4 * 32 * 32, 0)
    eager = decode_shape(positions, 32, c.bucket_min_saving)
    assert c.decode_read(positions, graph=False) == (eager[0], eager[1] - 1)
    assert c.replace(graph_max_rows=2).decode_read(positions)[0] == eager[0]  # beyond the graphs' rows: eager


def test_separate_forwards_price_a_decode_step_plus_a_prefill_only_step():
    """The embedded engine on a GPU (SGLang's default composition)."""
    mixed = GPU_LIKE.replace(prefill_mode="mixed", prefill_base_s=1e-3, prefill_per_token_s=1e-6,
                             paged_block_size=32, graph_max_rows=128)
    separate = mixed.replace(separate_prefill=True)
    positions = [40, 100, 700]
    read = separate.decode_read(positions)
    both = separate.mixed_step_s(3, 840, *read, 64, 64 * 65 / 2, 1)
    assert both == pytest.approx(separate.decode_step_s(3, 840, *read) + separate.mixed_step_s(0, 0, 0, 0, 64,
                                                                                                 64 * 65 / 2, 1))
    assert both > mixed.mixed_step_s(3, 840, *read, 64, 64 * 65 / 2, 1)  # launch-bound: two host floors, not one
    # nothing to prefill, or no row decoding: one forward either way
    assert separate.mixed_step_s(3, 840, *read, 0, 0, 0) == mixed.mixed_step_s(3, 840, *read, 0, 0, 0)
    assert separate.mixed_step_s(0, 0, 0, 0, 64, 10, 1) == mixed.mixed_step_s(0, 0, 0, 0, 64, 10, 1)
    assert EngineCostModel.from_dict(separate.to_dict()).separate_prefill


def test_a_calibration_cut_before_three_prefill_probes_gives_no_model():
    """An engine that counts its prefill forwards, calibrated on fewer than three probes."""
    from slime.rollout.simulator.calibrate import Calibrator
    from slime.rollout.simulator.probes import Probe

    cal = Calibrator("http://127.0.0.1:9", 100)
    cal.info = {"backend": "slime.hf_engine", "enable_mixed_chunk": False, "cuda_graph_mode": "capture",
                "cuda_graph_max_bs": 128, "max_running_requests": 128, "page_size": 32}
    cal.stats_ok = True
    probes = []
    for rows in (1, 4, 16, 64):  # decode at 2 ms + 10 us per row; a prefill forward 20 ms + 1 ms per chunk
        p = Probe([8] * rows, 32)
        p.runs.append((32 * (2e-3 + rows * 1e-5), [32, 32 * rows, 32 * rows * 24, 32 * rows * 64, 0]))
        t = 0.02 + 1e-3 * rows
        p.mixed.append((t, [1, 0, 0, 0, 0, 1, 8 * rows, 36 * rows, rows]))
        p.prefill.append((t, 1, 8 * rows, 64 * rows))
        probes.append(p)
    cal.probes = probes[:2]
    with pytest.raises(RuntimeError, match="prefill measured on 2 probe"):
        cal.fit()
    cal.probes = probes
    cost = cal.fit()
    assert cost.prefill_mode == "mixed" and cost.separate_prefill and cost.graph_max_rows == 128
    assert cost.mixed_step_s(0, 0, 0, 0, 8, 36, 1) == pytest.approx(0.021, rel=0.05)
