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


def test_wandb_keeps_its_files_under_the_run_dir_and_gets_redacted_flags(tmp_path, monkeypatch, base_args):
    import subprocess
    import sys

    home = tmp_path / "home"
    home.mkdir()
    run = tmp_path / "run"
    code = (
        "from slime.arguments import parse_args\n"
        "from slime.utils.metrics import MetricsLogger\n"
        f"args = parse_args({['--hf-checkpoint', base_args.hf_checkpoint, '--prompt-data', base_args.prompt_data, '--rm-type', 'remote_rm', '--rm-url', 'http://bob:hunter2@rm.local:9/x', '--rollout-batch-size', '1', '--num-rollout', '1', '--run-dir', str(run)]!r})\n"
        f"m = MetricsLogger(args, {str(run)!r}); m.log(0, {{'x': 1.0}}); print(m._wandb_run.config['rm_url']); m.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_DIR", "WANDB_CACHE", "WANDB_CONFIG", "WANDB_DATA", "XDG_"))}
    env.update(HOME=str(home), WANDB_MODE="offline", WANDB_SILENT="true",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "http://bob:***@rm.local:9/x"
    assert [str(p) for p in home.rglob("*")] == []  # nothing in ~/.cache/wandb (or anywhere else in HOME)
    for p in run.rglob("*"):
        if p.is_file():
            assert b"hunter2" not in p.read_bytes(), p
