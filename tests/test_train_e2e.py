"""train.py and train_async.py end to end on the embedded engine."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from slime.tasks import subtract_chain as task
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 4
STEPS = 4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train_e2e")
    task.write_dataset(str(d / "train.jsonl"), 200, seed=1, cap=16)
    task.write_dataset(str(d / "eval.jsonl"), 8, seed=2, cap=16)
    build_tiny_qwen3(str(d / "model"), build_tokenizer(task.VOCAB),
                     TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, intermediate_size=128, max_position_embeddings=256))
    return d


# (entry point, its extra flags): train.py, and train_async.py in one-step-off and stream mode
ENTRIES = {
    "sync": ("train.py", ("--over-sampling-batch-size", str(2 * BATCH))),
    "one_step_off": ("train_async.py", ("--over-sampling-batch-size", str(2 * BATCH))),
    "stream": ("train_async.py", ("--rollout-mode", "stream", "--rollout-pool-size", "16")),
}


def _cmd(d, *extra, out=None, mode="sync"):
    out = out or d
    entry, flags = ENTRIES[mode]
    return [sys.executable, os.path.join(REPO, entry),
            "--hf-checkpoint", str(d / "model"), "--prompt-data", str(d / "train.jsonl"),
            "--input-key", "prompt", "--label-key", "label", "--custom-rm-path", "tests.plugins_for_tests.parity_reward",
            "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", "4", "--rollout-max-response-len", "48",
            "--num-rollout", str(STEPS), "--partial-rollout",
            "--lr", "1e-4", "--use-tis", "--run-dir", str(out / "run"), "--save", str(out / "ckpt"), "--save-interval", "1",
            "--save-debug-rollout-data", str(out / "rollouts" / "rollout_{rollout_id}.json"), *flags, *extra]


def _latest(out):
    p = out / "ckpt" / "latest_checkpointed_iteration.txt"
    return int(p.read_text()) if p.exists() else -1


def _wait_gone(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def _children(pid):
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _kill_then_resume(d, out, *extra, mode="sync"):
    """Run, kill -9 after the second checkpoint, resume with --load: the ledger and the trained groups are exact."""
    out.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log1 = open(out / "first.log", "w")
    proc = subprocess.Popen(_cmd(d, *extra, out=out, mode=mode), cwd=REPO, env=env, stdout=log1,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while _latest(out) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"train.py ended before it could be killed:\n{(out / 'first.log').read_text()[-3000:]}"
    children = _children(proc.pid)
    # sglang-router renames itself (setproctitle "sglang::router") once it has started
    router = [p for p in children if re.search(rb"sglang_router|sglang::router", open(f"/proc/{p}/cmdline", "rb").read())]
    placement = json.loads((out / "run" / "placement.json").read_text())
    # the engines' servers are children of their host actors (Ray workers), not of the driver
    servers = [e["server_pid"] for e in placement["engines"]]
    hosts = [e["pid"] for e in placement["engines"]] + [t["pid"] for t in placement["trainers"]]
    assert servers and all(b"hf_engine" in open(f"/proc/{p}/cmdline", "rb").read() for p in servers)
    assert not set(servers) & set(children) and router
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    killed_at = _latest(out)
    assert 1 <= killed_at < STEPS - 1
    # Engines, their hosts, the trainers and the router die with the driver (no orphans serving stale weights).
    assert _wait_gone(router + servers + hosts) == []

    done = subprocess.run(_cmd(d, *extra, "--load", str(out / "ckpt"), out=out, mode=mode), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"at rollout {killed_at + 1}" in done.stderr + done.stdout
    assert _latest(out) == STEPS - 1

    final = out / "ckpt" / f"iter_{STEPS - 1:07d}"
    ledger = json.loads((final / "buffer" / "buffer.json").read_text())["ledger"]["state"]
    driver = json.loads((final / "driver_state.json").read_text())
    # Every group the data source ever issued has exactly one state, with no gap in the ids.
    assert sorted(int(k) for k in ledger) == list(range(driver["rollout"]["data_source"]["group_counter"]))
    trained_in_ledger = sorted(int(k) for k, v in ledger.items() if v == "trained")
    assert len(trained_in_ledger) == STEPS * BATCH
    assert driver["rollout"]["policy_version"] == STEPS

    # The groups trained in each step (as dumped by the surviving history): none twice, each the prompt row
    # that the data source's order says (no prompt repeated or skipped).
    trained = []
    for rid in range(STEPS):
        groups = json.load(open(out / "rollouts" / f"rollout_{rid}.json"))["groups"]
        assert len(groups) == BATCH
        for g in groups:
            assert len({s["group_index"] for s in g}) == 1 and len(g) == 4
            assert all(s["metadata"]["row"] == s["group_index"] for s in g)
            trained.append(g[0]["group_index"])
    assert sorted(trained) == trained_in_ledger

    rows = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    last = [r for r in rows if r["step"] == STEPS - 1][-1]
    for key in ("rollout/tokens_per_s", "rollout/off_policy_token_ratio", "reward/mean", "train/tis_ess",
                "weight_sync/weight_sync_time_s", "perf/step_time_s", "perf/trainer_busy_s", "perf/engine_idle_s"):
        assert key in last
    # Every checkpoint was taken with nothing in flight: each group parked, ready, trained or dropped, none issued.
    for ckpt in sorted((out / "ckpt").glob("iter_*")):
        states = json.loads((ckpt / "buffer" / "buffer.json").read_text())["ledger"]["state"].values()
        assert "issued" not in states, ckpt.name
    if mode != "sync":  # the rollout ran ahead of the trainer: part of some batch came from an older version
        assert any(r.get("rollout/off_policy_token_ratio", 0) > 0 for r in rows if r["step"] >= 0)


@pytest.mark.parametrize("mode", ["one_step_off", "stream"])
def test_kill_dash_nine_then_resume_in_train_async(workdir, mode):
    """train_async.py: a checkpoint parks everything in flight first, so the same ledger audit holds."""
    _kill_then_resume(workdir, workdir / mode, mode=mode)


def test_kill_dash_nine_then_resume_with_the_megatron_backend_at_tp2(workdir):
    """train.py (FSDP's kill -9 and resume under faults: tests/test_faults.py)."""
    out = workdir / "megatron"
    _kill_then_resume(workdir, out, "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                      "--tensor-model-parallel-size", "2", "--use-distributed-optimizer")
    meta = json.loads((out / "ckpt" / f"iter_{STEPS - 1:07d}" / "trainer" / "trainer_meta.json").read_text())
    assert meta["backend"] == "megatron" and meta["tp"] == 2
    # disaggregated: every update went over the broadcast group (the default without --colocate), both TP ranks
    rows = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    synced = [r for r in rows if "weight_sync/weight_sync_tensor" in r]
    assert len(synced) == STEPS and all(r["weight_sync/weight_sync_tensor"] == 0.0
                                        and r["weight_sync/weight_sync_from_disk"] == 0.0 for r in synced)


def test_export_hf_gives_a_loadable_model_with_the_trained_weights(workdir):
    # Runs after the stream-mode resume (same module): its last (FSDP) checkpoint exists.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = workdir / "stream"
    if _latest(d) < 0:
        pytest.skip("needs the checkpoint of the stream-mode resume")
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools/export_hf.py"), "--load", str(d / "ckpt"),
                          "--out", str(d / "hf")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    model = AutoModelForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(d / "hf"))
    assert tok.decode(tok.encode("47-5=", add_special_tokens=False)) == "47-5="
    trained = load_file(str(d / "ckpt" / f"iter_{STEPS - 1:07d}" / "trainer" / "model.safetensors"))
    initial = load_file(str(workdir / "model" / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[name], trained[name])
    assert not torch.equal(trained[name], initial[name])  # training moved the weights


def test_debug_rollout_only_then_debug_train_only_from_saved_rollouts(workdir, tmp_path):
    d = workdir
    dump = tmp_path / "dump_{rollout_id}.json"
    common = ["--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"), "--save-interval", "2",
              "--num-rollout", "2", "--save-debug-rollout-data", str(dump)]
    base = [a for a in _cmd(d) if a not in ()]
    # drop the module run's --run-dir/--save/--save-interval/--save-debug-rollout-data/--num-rollout values
    cleaned, skip = [], 0
    for a in base:
        if skip:
            skip -= 1
            continue
        if a in ("--run-dir", "--save", "--save-interval", "--save-debug-rollout-data", "--num-rollout"):
            skip = 1
            continue
        cleaned.append(a)
    gen = subprocess.run(cleaned + common + ["--debug-rollout-only"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    dumps = [json.load(open(str(dump).format(rollout_id=i))) for i in range(2)]
    assert all(len(x["groups"]) == BATCH for x in dumps)
    assert "FSDPTrainer" not in gen.stderr  # no trainer in rollout-only mode

    train_only = [a for a in cleaned if a not in ("--partial-rollout",)]
    common_train = ["--run-dir", str(tmp_path / "run2"), "--num-rollout", "2", "--load-debug-rollout-data", str(dump)]
    tr = subprocess.run(train_only + common_train + ["--debug-train-only"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert tr.returncode == 0, tr.stderr[-3000:]
    assert "hf_engine" not in tr.stderr  # no engines in train-only mode
    rows = [json.loads(line) for line in open(tmp_path / "run2" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["train/num_samples"] == BATCH * 4 for r in rows)
    # the rewards come from the saved rollouts, not from a new generation
    assert rows[0]["reward/mean"] == pytest.approx(
        sum(s["reward"] for g in dumps[0]["groups"] for s in g) / (BATCH * 4))
