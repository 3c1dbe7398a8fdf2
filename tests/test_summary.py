"""The end-of-run summary (slime/utils/summary.py)."""

import json
import logging

import pytest

from slime.utils.summary import guard_line, log_run_summary, max_lag, staleness_line, summarize


def rows(lags_per_step: list[dict[int, int]], ratio: float) -> list[dict]:
    out = [{"step": -1, "eval/accuracy": 0.5}]
    for i, lags in enumerate(lags_per_step):
        r = {"step": i, "reward/mean": 0.1 * i, "rollout/tokens_per_s": 100.0, "rollout/off_policy_token_ratio": ratio}
        r.update({f"rollout/staleness_hist/lag_{lag}": float(n) for lag, n in lags.items()})
        out.append(r)
    out.append({"step": len(lags_per_step) - 1, "eval/accuracy": 0.7})
    return out


def test_the_largest_lag_is_the_largest_lag_with_tokens():
    assert max_lag(rows([{0: 10, 1: 5}, {0: 3, 3: 2, 7: 0}], 0.4)) == 3
    assert max_lag(rows([{0: 10}], 0.0)) == 0
    assert max_lag([{"step": 0}]) is None


def test_the_line_says_what_the_ratio_and_the_cap_mean(base_args):
    s = summarize(rows([{0: 10, 1: 5}, {0: 3, 4: 2}], 0.4))
    assert s["max_lag"] == 4 and s["off_policy_token_ratio"] == 0.4
    assert s["eval_accuracy_first"] == 0.5 and s["eval_accuracy_last"] == 0.7
    capped = staleness_line(s, base_args.replace(max_staleness=4, use_tis=True))
    assert "0.400" in capped and "older policy" in capped and "corrected by TIS" in capped
    assert "largest lag 4 versions <= --max-staleness 4" in capped and "(the length guard)" in capped
    unguarded = staleness_line(s, base_args.replace(max_staleness=4, disable_length_guard=True))
    assert "regenerated" in unguarded and "length guard" not in unguarded
    masked = staleness_line(s, base_args.replace(max_staleness=4, staleness_policy="mask"))
    assert "out of the loss" in masked and "uncorrected" in masked
    assert "uncapped" in staleness_line(s, base_args.replace(max_staleness=None))
    over = staleness_line(s, base_args.replace(max_staleness=2))
    assert "largest lag 4 versions, OVER --max-staleness 2" in over and "<=" not in over
    on_policy = staleness_line(summarize(rows([{0: 10}], 0.0)), base_args)
    assert "every trained token was sampled by the policy it trained" in on_policy


def test_summary_json_records_the_cap(base_args, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows([{0: 1, 2: 1}], 0.5)))
    out = log_run_summary(str(tmp_path), str(metrics), base_args.replace(max_staleness=2, save=None))
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == out and saved["max_lag"] == 2 and saved["max_staleness"] == 2


def test_summary_counts_restarts_to_the_end(base_args, tmp_path, caplog):
    """A restart found after the last metrics row (in the last checkpoint's save) is in no row: the summary has it."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows([{0: 1}], 0.0)))
    with caplog.at_level("INFO"):
        out = log_run_summary(str(tmp_path), str(metrics), base_args.replace(save=None),
                              restarts={"engine": 0, "router": 1, "trainer": 1})
    assert json.loads((tmp_path / "summary.json").read_text())["restarts"] == {"engine": 0, "router": 1, "trainer": 1}
    assert out["restarts"]["trainer"] == 1 and "restarts: engine 0, router 1, trainer 1" in caplog.text
    assert log_run_summary(str(tmp_path), str(metrics), base_args.replace(save=None))["restarts"] == {}


def _eval_row(step: int, scores: list, prompts: str = "p1") -> dict:
    return {"step": step, "set": "held_out", "prompts": prompts, "scores": scores}


def test_paired_gain_and_its_interval():
    from slime.utils.eval_scores import accuracy_interval, gain_line, paired_gain

    # 10 of 40 prompts turn right, none turn wrong: gain 0.25, sd of the differences sqrt(0.25 * 0.75 * 40 / 39)
    before, after = [0.0] * 30 + [1.0] * 10, [0.0] * 20 + [1.0] * 20
    g = paired_gain(_eval_row(-1, before), _eval_row(9, after))
    half = 1.959963984540054 * (0.25 * 0.75 * 40 / 39) ** 0.5 / 40 ** 0.5
    assert g["prompts"] == 40 and abs(g["gain"] - 0.25) < 1e-12
    assert abs(g["gain_interval"][0] - (0.25 - half)) < 1e-12 and abs(g["gain_interval"][1] - (0.25 + half)) < 1e-12
    assert g["before"][0] == 0.25 and g["after"][0] == 0.5
    # the same accuracies with every prompt changing (10 right -> wrong, 20 wrong -> right): a wider interval
    shuffled = paired_gain(_eval_row(-1, [1.0] * 10 + [0.0] * 30), _eval_row(9, [0.0] * 10 + [1.0] * 20 + [0.0] * 10))
    assert abs(shuffled["gain"] - 0.25) < 1e-12 and shuffled["gain_interval"][0] < g["gain_interval"][0]
    assert gain_line(g).startswith("eval gain: +0.250 (95% interval +0.1")
    assert accuracy_interval([0.0] * 5) == (0.0, 0.0, 0.0) and accuracy_interval([1.0, 1.0, None]) == (1.0, 1.0, 1.0)
    # prompts without a score (every sample failed) on either side are left out of the pairs
    assert paired_gain(_eval_row(-1, [0.0, None, 1.0]), _eval_row(1, [1.0, 1.0, None]))["prompts"] == 1


def test_no_paired_gain_over_different_prompts():
    import pytest

    from slime.utils.eval_scores import paired_gain

    with pytest.raises(ValueError, match="different prompts"):
        paired_gain(_eval_row(-1, [0.0, 1.0]), _eval_row(3, [1.0, 1.0], prompts="p2"))


def test_the_summary_prints_the_gain_from_the_first_eval_to_the_last(base_args, tmp_path, caplog):
    from slime.utils.eval_scores import EVAL_SCORES

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows([{0: 1}], 0.0)))
    (tmp_path / EVAL_SCORES).write_text("".join(json.dumps(r) + "\n" for r in (
        _eval_row(4, [0.0, 1.0, 1.0, 1.0]), _eval_row(-1, [0.0, 0.0, 1.0, 0.0]), _eval_row(1, [0.0, 1.0, 0.0, 0.0]))))
    with caplog.at_level("INFO"):
        out = log_run_summary(str(tmp_path), str(metrics), base_args.replace(save=None))
    (g,) = out["eval_gains"]
    assert (g["from_step"], g["to_step"], g["prompts"], g["gain"]) == (-1, 4, 4, 0.5)
    assert "eval gain: +0.500 (95% interval" in caplog.text
    assert "eval accuracy [held_out] step -1 -> 4, 4 prompts: 0.250" in caplog.text
    assert json.loads((tmp_path / "summary.json").read_text()) == out


def test_the_run_summary_reports_tool_use(tmp_path, base_args, caplog):
    rows = [{"step": -1, "eval/accuracy": 0.4, "eval/tiny/tool/call_rate": 0.5, "eval/tiny/tool/calls_per_sample_mean": 1.3}]
    rows += [{"step": i, "reward/mean": 0.5, "rollout/tool/call_rate": 0.5 + 0.05 * i, "rollout/tool/failures": float(i == 2)}
             for i in range(8)]
    rows += [{"step": 7, "eval/accuracy": 0.6, "eval/tiny/tool/call_rate": 0.8, "eval/tiny/tool/calls_per_sample_mean": 3.5}]
    s = summarize(rows)
    assert (s["eval_tool_call_rate_first"], s["eval_tool_call_rate_last"]) == (0.5, 0.8)
    assert s["tool_call_rate_first_quarter"] == pytest.approx(0.525) and s["tool_failures"] == 1.0
    assert "tool_call_rate_first_quarter" not in summarize([r for r in rows if "rollout/tool/call_rate" not in r])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.INFO, logger="slime.utils.summary"):
        log_run_summary(str(tmp_path), str(tmp_path / "metrics.jsonl"), base_args)
    assert "tool-call rate, eval (model turns ending in a call): 0.500 -> 0.800" in caplog.text


def test_the_summary_says_whether_the_length_guard_acted_and_how_often(base_args):
    steps = rows([{0: 1}] * 4, 0.2)
    steps[1]["rollout/staleness_guard_masked"] = 3.0
    steps[3]["rollout/staleness_in_flight_guard_masked"] = 2.0
    steps[3]["rollout/staleness_guard_masked_groups_at_train"] = 1.0
    s = summarize(steps)
    assert (s["guard_masked_samples"], s["guard_masked_groups"], s["guard_steps"]) == (5.0, 1.0, 2)
    line = guard_line(s, base_args.replace(max_staleness=4))
    assert line.startswith(f"length guard: on, acted in 2 of {s['steps']} steps: 5 samples") and "1 finished groups" in line
    assert "off (--disable-length-guard)" in guard_line(s, base_args.replace(max_staleness=4, disable_length_guard=True))
    assert "not needed" in guard_line(s, base_args.replace(max_staleness=4, staleness_policy="mask"))
    assert "not needed" in guard_line(s, base_args)  # no cap
