"""benchmarks/real_model.py --reuse."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from slime.utils.summary import LAG_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# loaded under its own name: `real_model` is tests/real_model.py, the real-model tests' helpers
_spec = importlib.util.spec_from_file_location("real_model_benchmark", os.path.join(REPO, "benchmarks", "real_model.py"))
real_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model)


def write_run(run_dir, steps: int, step_s: float, new_tokens: float, lag1_share: float, scores_after: list[float]):
    """A finished run of `steps` steps of 32 samples: 10 s of rollout a step, an eval before and after."""
    os.makedirs(run_dir)
    rows = [{"step": -1, "eval/accuracy": 0.5}]
    for s in range(steps):
        rows.append({"step": s, "perf/step_time_s": step_s, "perf/rollout_s": 10.0, "perf/train_s": step_s - 10.0,
                     "train/num_samples": 32, "rollout/new_tokens": new_tokens, "rollout/response_len_mean": 12.0,
                     f"{LAG_PREFIX}0": 100.0 * (1 - lag1_share), f"{LAG_PREFIX}1": 100.0 * lag1_share})
    rows[-1]["eval/accuracy"] = sum(scores_after) / len(scores_after)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(os.path.join(run_dir, "eval_scores.jsonl"), "w") as f:
        for step, scores in ((-1, [1.0, 0.0, 1.0, 0.0]), (steps - 1, scores_after)):
            f.write(json.dumps({"step": step, "set": "held_out", "prompts": "d1", "scores": scores}) + "\n")
    from slime.utils.eval_scores import first_to_last

    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"steps": steps, "max_lag": 1, "eval_gains": first_to_last(str(run_dir))}, f)


def test_reused_arms_make_the_table_without_running_anything(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench"
    write_run(out / "april", 3, step_s=20.0, new_tokens=600.0, lag1_share=0.5, scores_after=[1.0, 1.0, 1.0, 0.0])
    write_run(out / "sync", 3, step_s=40.0, new_tokens=400.0, lag1_share=0.0, scores_after=[1.0, 0.0, 1.0, 1.0])
    (out / "sync.json").write_text(json.dumps({"whole_run_s": 200.0, "load_before": 1.5, "load_after": 2.5}))
    monkeypatch.setattr(real_model, "run_quickstart", lambda *a, **k: pytest.fail("a reused arm was run"))
    argv = ["--reuse", "april,sync", "--steps", "3", "--sglang-steps", "0", "--no-calibrate", "--out", str(out)]
    assert real_model.main(argv) == 0
    res = json.loads((out / "real_model.json").read_text())
    april, sync = res["runs"]["april"], res["runs"]["sync"]
    assert april["reused"] and sync["reused"]
    assert april["samples_per_s"] == pytest.approx(96 / 60) and sync["samples_per_s"] == pytest.approx(96 / 120)
    assert res["ratios"]["embedded"]["samples_per_s"] == pytest.approx(2.0)
    assert res["ratios"]["embedded"]["rollout_tokens_per_s"] == pytest.approx(1.5)
    assert april["off_policy_token_share"] == pytest.approx(0.5) and sync["off_policy_token_share"] == 0.0
    assert april["eval_gain"] == pytest.approx(0.25) and res["april_minus_sync"]["difference"] == 0.0
    md = (out / "real_model.md").read_text()
    assert "APRIL / sync trained samples/s 2.00x" in md
    assert "rollout 30 s against 30 s, training 30 s against 90 s" in md  # where the time went, arm by arm
    assert "| n/a -> n/a |" in md and "| 1.5 -> 2.5 |" in md  # the load where the arm's own run saved it


def test_an_unfinished_or_other_length_arm_is_refused(tmp_path):
    out = tmp_path / "bench"
    write_run(out / "april", 3, step_s=20.0, new_tokens=600.0, lag1_share=0.5, scores_after=[1.0, 1.0, 1.0, 0.0])
    with pytest.raises(SystemExit, match="ran 3 steps, this benchmark runs 5"):
        real_model.main(["--reuse", "april", "--steps", "5", "--sglang-steps", "0", "--out", str(out)])
    os.remove(out / "april" / "summary.json")
    with pytest.raises(SystemExit, match="no finished run"):
        real_model.main(["--reuse", "april", "--steps", "3", "--sglang-steps", "0", "--out", str(out)])
    with pytest.raises(SystemExit):
        real_model.main(["--reuse", "april,bogus", "--out", str(out)])
