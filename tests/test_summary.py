"""The end-of-run summary (slime/utils/summary.py): what it reads from metrics.jsonl and the one line that says
what the off-policy token ratio and the staleness cap mean."""

import json

from slime.utils.summary import log_run_summary, max_lag, staleness_line, summarize


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
    assert "largest lag 4 versions <= --max-staleness 4" in capped and "regenerated" in capped
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
