"""The simulator-vs-measurement benchmark's verdict arithmetic (benchmarks/simulator_check.py)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import simulator_check as sc  # noqa: E402


def test_pooled_errors_weigh_runs_by_their_tokens_per_second():
    runs = [{m: {"sim_tok_s": 110.0, "measured_tok_s": 100.0} for m in sc.MODES},
            {m: {"sim_tok_s": 300.0, "measured_tok_s": 200.0} for m in sc.MODES}]
    assert sc.pooled_errors(runs)["sync"] == pytest.approx(410 / 300 - 1)
    assert sc.pooled_errors(runs[:1])["pool"] == pytest.approx(0.1)


def run(share=1.0, speed=1.0):
    return {m: {"engine_cpu_share": share, "box_speed_vs_calibration": speed} for m in sc.MODES}


def test_a_run_is_not_counted_when_the_engine_lacked_its_core_or_the_box_changed_speed():
    assert sc.wall_clock_problem(run()) is None
    assert "oversubscribed" in sc.wall_clock_problem(run(share=0.5))
    assert "speed moved" in sc.wall_clock_problem(run(speed=1.2))


def test_a_second_run_is_made_only_when_the_first_misses(monkeypatch, tmp_path):
    sims = {0: {m: {"sim_tok_s": 130.0, "measured_tok_s": 100.0, "engine_cpu_share": 1.0,
                    "box_speed_vs_calibration": 1.0, "error": 0.3} for m in sc.MODES},
            1: {m: {"sim_tok_s": 90.0, "measured_tok_s": 100.0, "engine_cpu_share": 1.0,
                    "box_speed_vs_calibration": 1.0, "error": -0.1} for m in sc.MODES}}
    seen = []
    monkeypatch.setattr(sc, "run_benchmark", lambda out, seed: seen.append(seed) or sims[seed])
    result = sc.check(str(tmp_path))
    assert seen == [0, 1] and result["verdict"] == "within"
    assert result["pooled_errors"]["april"] == pytest.approx(220 / 200 - 1)
    seen.clear()
    assert sc.check(str(tmp_path), seeds=(1,))["verdict"] == "within" and seen == [1]
    sims[1] = sims[0]
    assert sc.check(str(tmp_path))["verdict"] == "outside"
