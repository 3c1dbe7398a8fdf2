import json
import os
import time

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


def _wandb_history(run_file) -> list[dict] | None:
    """The history rows of an offline run's `.wandb` file, None until its exit record is written."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunks, rows, ended = 7, b"", [], False
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks = data[pos + 7:pos + 7 + n] if kind in (1, 2) else chunks + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
            ended = ended or record.WhichOneof("record_type") == "exit"
    return rows if ended else None


def test_the_eval_before_the_first_step_reaches_wandb_and_the_jsonl(tmp_path, monkeypatch, base_args):
    """The eval before training is step -1 (the JSONL, the summaries)."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = MetricsLogger(base_args.replace(use_wandb=True, wandb_mode="offline", wandb_project="t"), str(tmp_path))
    m.log(-1, {"eval/accuracy": 0.25})
    m.log(0, {"reward/mean": 0.5, "eval/accuracy": 0.5})
    m.log(1, {"reward/mean": 0.75})
    m.close()
    assert [(r["step"], r.get("eval/accuracy")) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(-1, 0.25), (0, 0.5), (1, None)]
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60  # wandb-core writes the file's last records after finish() returns
    while (history := _wandb_history(run_file)) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert history is not None, "the offline run has no exit record"
    assert [(r["_step"], r["rollout/step"], r.get("eval/accuracy")) for r in history] == \
        [(0, -1, 0.25), (1, 0, 0.5), (2, 1, None)]
