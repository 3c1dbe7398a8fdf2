"""tools/plot_run.py writes every picture for a run directory (metrics.jsonl + rollout_trace.jsonl)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

from slime.rollout.simulator import EngineCostModel

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def _plot_run():
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import plot_run
    finally:
        sys.path.pop(0)
    return plot_run


def write_run(run_dir, partial: bool, steps: int = 8, seed: int = 0) -> None:
    """A run directory as train.py writes it, with made-up but consistent numbers."""
    rng = random.Random(seed)
    os.makedirs(run_dir, exist_ok=True)
    rows, trace = [{"step": -1, "eval/accuracy": 0.5}], []
    for i in range(steps):
        finished = [[rng.randint(2, 40) for _ in range(4)] for _ in range(6)]
        new = sum(map(sum, finished)) + 50
        dt = 0.2 + rng.random() * 0.3
        lag1 = 40 * i if partial else 0
        row = {"step": i, "reward/mean": 0.4 + 0.02 * i, "rollout/tokens_per_s": new / dt,
               "rollout/off_policy_token_ratio": lag1 / (lag1 + 300), "rollout/staleness_hist/lag_0": 300.0,
               "rollout/over_sampling_batch_size": 8.0 if partial else 4.0}
        if lag1:
            row["rollout/staleness_hist/lag_1"] = float(lag1)
        if i % 4 == 3:
            row["eval/accuracy"] = 0.5 + 0.03 * i
        rows.append(row)
        occ = [[0.0, 0]] + [[round(0.01 * k, 3), min(k, 16)] for k in range(1, 20)] + [[round(dt, 3), 0]]
        trace.append({"rollout_id": i, "mode": "chunked", "partial_rollout": partial, "target": 4,
                      "n_samples_per_prompt": 4, "in_flight_cap": 64, "num_engines": 1,
                      "over_sampling_batch_size": 8 if partial else 4, "max_response_len": 64, "ignore_eos": False,
                      "finished_lengths": finished, "unfinished_lengths": [rng.randint(5, 60)] if partial else [],
                      "prompt_len": 6, "occupancy": occ, "new_tokens": new, "step_time_s": dt, "tokens_per_s": new / dt,
                      "accepted": [1, 2, 3, 4], "rejected": {}, "first_request_t": 0.01, "drained_t": dt - 0.01})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run_dir, "rollout_trace.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in trace)


def test_every_picture_is_written_and_is_a_png(tmp_path):
    april, sync = str(tmp_path / "quickstart-april"), str(tmp_path / "quickstart-sync")
    write_run(april, partial=True)
    write_run(sync, partial=False, seed=1)
    EngineCostModel(decode_base_s=2e-3, decode_per_seq_s=1e-5, prefill_per_token_s=1e-5, admit_wait_s=0.02,
                    name="test engine").save(os.path.join(april, "cost_model.json"))
    paths = _plot_run().plot_run(april)
    names = sorted(os.path.basename(p) for p in paths)
    assert names == ["lengths.png", "occupancy.png", "off_policy.png", "reward.png", "simulator.png", "throughput.png"]
    for p in paths:
        assert os.path.dirname(p) == os.path.join(april, "plots")
        with open(p, "rb") as f:
            head = f.read(8)
        assert head == PNG and os.path.getsize(p) > 5_000
    sim = json.load(open(os.path.join(april, "plots", "simulator.json")))
    assert sim["measured_mean_tokens_per_s"] > 0 and sim["simulated_mean_tokens_per_s"] > 0
    assert _plot_run().sibling(april) == sync


def test_a_run_without_trace_or_cost_model_still_gets_its_metric_plots(tmp_path, capsys):
    run = str(tmp_path / "run")
    write_run(run, partial=True)
    os.remove(os.path.join(run, "rollout_trace.jsonl"))
    assert _plot_run().main([run]) == 0
    out = capsys.readouterr().out
    assert "plots written to" in out and "reward.png" in out and "simulator.png" not in out
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        _plot_run().plot_run(str(tmp_path / "empty"))


def test_staleness_lags_are_banded_so_the_legend_stays_short():
    bands = _plot_run().lag_bands(list(range(31)))
    assert [b for b, _ in bands] == ["0", "1", "2", "3-4", "5-8", "9-16", "17+"]
    held = [g for _, h in bands for g in h]
    assert sorted(held) == list(range(31))  # every lag in exactly one band
    assert [b for b, _ in _plot_run().lag_bands([0, 6])] == ["0", "5-8"]  # only the bands that hold a lag


def test_a_multi_turn_run_gets_its_tool_use_picture(tmp_path):
    run = str(tmp_path / "agent")
    write_run(run, partial=True)
    rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    for r in rows:
        if r["step"] >= 0:
            r["rollout/tool/call_rate"] = 0.3 + 0.05 * r["step"]
            r["rollout/tool/calls_per_sample_mean"] = 1.0 + 0.3 * r["step"]
        if "eval/accuracy" in r:
            r["eval/tiny/tool/call_rate"] = 0.3 + 0.05 * max(0, r["step"])
            r["eval/tiny/tool/calls_per_sample_mean"] = 1.0 + 0.3 * max(0, r["step"])
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    paths = _plot_run().plot_run(run)
    tools = [p for p in paths if os.path.basename(p) == "tools.png"]
    assert tools and open(tools[0], "rb").read(8) == PNG and os.path.getsize(tools[0]) > 5_000
    write_run(str(tmp_path / "plain"), partial=True)  # no tool metrics: no tools.png
    assert "tools.png" not in [os.path.basename(p) for p in _plot_run().plot_run(str(tmp_path / "plain"))]
