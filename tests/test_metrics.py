import json
import os

from slime.utils.metrics import MetricsLogger, read_metrics


def test_jsonl_one_object_per_step(tmp_path, base_args):
    args = base_args.replace(use_wandb=False)
    m = MetricsLogger(args, str(tmp_path))
    m.log(0, {"rollout/tokens_per_s": 10.5, "reward/mean": float("nan"), "hist": [1, 2]})
    m.log(1, {"rollout/tokens_per_s": 11.0, "eval/accuracy": 0.5})
    rows = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["reward/mean"] is None and rows[0]["hist"] == [1, 2]
    assert rows[1]["eval/accuracy"] == 0.5 and "eval/accuracy" not in rows[0]


def test_wandb_offline_writes_a_run(tmp_path, monkeypatch, base_args):
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = base_args.replace(use_wandb=True, wandb_mode="offline", wandb_project="t")
    m = MetricsLogger(args, str(tmp_path))
    m.log(0, {"x": 1.0})
    m.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    assert len(runs) == 1
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["x"] == 1.0
