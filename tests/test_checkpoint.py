import json
import os
import random

import numpy as np
import pytest
import torch

from slime.utils.checkpoint import latest_checkpoint, read_driver_state, rng_state, save_checkpoint, set_rng_state


def _writer(text):
    def write(d):
        with open(os.path.join(d, "part.txt"), "w") as f:
            f.write(text)
    return write


def test_save_publishes_atomically_and_latest_points_to_it(tmp_path):
    assert latest_checkpoint(str(tmp_path)) is None
    save_checkpoint(str(tmp_path), 3, {"trainer": _writer("a")}, {"policy_version": 3})
    path = latest_checkpoint(str(tmp_path))
    assert path.endswith("iter_0000003")
    assert read_driver_state(path) == {"policy_version": 3}
    assert open(os.path.join(path, "trainer", "part.txt")).read() == "a"


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    save_checkpoint(str(tmp_path), 1, {"trainer": _writer("old")}, {"policy_version": 1})

    def crash(d):
        raise RuntimeError("killed mid-save")

    with pytest.raises(OSError, match="killed mid-save"):  # CheckpointSaveError names the part and the cause
        save_checkpoint(str(tmp_path), 2, {"trainer": _writer("new"), "buffer": crash}, {"policy_version": 2})
    path = latest_checkpoint(str(tmp_path))
    assert path.endswith("iter_0000001")
    assert read_driver_state(path)["policy_version"] == 1
    assert not os.path.exists(tmp_path / "iter_0000002")


def test_pointer_to_missing_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(FileNotFoundError, match="iter_0000009"):
        latest_checkpoint(str(tmp_path))


def test_rng_state_round_trip_through_json():
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    state = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


@pytest.mark.parametrize("tracker, name", [("0", "iter_0000000"), ("release", "release")])
def test_load_of_a_model_only_checkpoint_names_the_conversion(tmp_path, tracker, name):
    """Our converter's output, or upstream slime's (`release/`, or a training checkpoint's `iter_N/`)."""
    (tmp_path / name).mkdir()
    (tmp_path / name / "metadata.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(tracker)
    with pytest.raises(FileNotFoundError, match=f"torch_dist model checkpoint.*--ref-load.*python tools/"
                                                f"convert_torch_dist_to_hf.py --input-dir {tmp_path / name} "):
        latest_checkpoint(str(tmp_path))


# ---- faults: unwritable / full --save, stale tmp dirs, corrupt checkpoints, changed data contract ----
import subprocess  # noqa: E402
import sys  # noqa: E402

from slime.utils.checkpoint import (  # noqa: E402
    CheckpointLoadError,
    CheckpointSaveError,
    check_data_contract,
    data_contract,
    prepare_save_dir,
    resolve_checkpoint,
)
from slime.utils.metrics import truncate_jsonl  # noqa: E402


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


def test_prepare_save_dir_removes_stale_tmp_dirs_of_dead_runs_only(tmp_path):
    save_checkpoint(str(tmp_path), 1, {"trainer": _writer("a")}, {"policy_version": 1})
    stale = tmp_path / f"iter_0000002.tmp-{_dead_pid()}"
    (stale / "trainer").mkdir(parents=True)
    live = tmp_path / f"iter_0000003.tmp-{os.getppid()}"  # a running process (pytest's parent) may be saving
    live.mkdir()
    prepare_save_dir(str(tmp_path))
    assert not stale.exists() and live.exists()
    assert latest_checkpoint(str(tmp_path)).endswith("iter_0000001")


def test_unwritable_or_too_small_save_dir_fails_at_start_naming_path_and_cause(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointSaveError, match=r"--save .*a_file/ckpt: not writable \(Not a directory"):
        prepare_save_dir(str(blocker / "ckpt"))
    with pytest.raises(CheckpointSaveError, match=r"MB free, but one checkpoint needs about"):
        prepare_save_dir(str(tmp_path / "ok"), need_bytes=1 << 60)


def test_failed_save_names_part_and_cause_and_leaves_no_tmp_dir(tmp_path):
    save_checkpoint(str(tmp_path), 1, {"trainer": _writer("old")}, {"policy_version": 1})

    def full_disk(d):
        raise OSError(28, "No space left on device", os.path.join(d, "optimizer.pt"))

    with pytest.raises(CheckpointSaveError) as err:
        save_checkpoint(str(tmp_path), 2, {"buffer": _writer("b"), "trainer": full_disk}, {"policy_version": 2})
    msg = str(err.value)
    assert "iter_0000002" in msg and "writing trainer/" in msg and "No space left on device" in msg
    assert "short write" in msg and "MB free on" in msg
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert latest_checkpoint(str(tmp_path)).endswith("iter_0000001")
    save_checkpoint(str(tmp_path), 2, {"trainer": _writer("new")}, {"policy_version": 2})  # the next save works


def test_short_write_under_a_file_size_limit_is_named(tmp_path):
    """A real short write (torch's cryptic 'unexpected pos'): RLIMIT_FSIZE stands in for a full disk."""
    code = f"""
import resource, signal, torch, sys
from slime.utils.checkpoint import save_checkpoint, CheckpointSaveError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    save_checkpoint({str(tmp_path)!r}, 0, {{"trainer": lambda d: torch.save(torch.zeros(1 << 20), d + "/optimizer.pt")}}, {{}})
except CheckpointSaveError as e:
    print(e)
    sys.exit(3)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 3, out.stderr[-2000:]
    assert "writing trainer/" in out.stdout and "unexpected pos" in out.stdout and "short write" in out.stdout
    assert [p.name for p in tmp_path.iterdir()] == []


def test_corrupt_newest_checkpoint_is_named_and_the_previous_intact_one_offered(tmp_path):
    state = {"rollout_id": 0, "rollout": {}, "rng": {}}

    def buffer(d):
        with open(os.path.join(d, "buffer.json"), "w") as f:
            f.write("{}")

    for rid in (3, 5):
        save_checkpoint(str(tmp_path), rid, {"buffer": buffer}, {**state, "rollout_id": rid})
    assert resolve_checkpoint(str(tmp_path)).endswith("iter_0000005")
    (tmp_path / "iter_0000005" / "driver_state.json").write_text('{"rollout_id": 5, "roll')
    with pytest.raises(CheckpointLoadError) as err:
        resolve_checkpoint(str(tmp_path))
    msg = str(err.value)
    assert "iter_0000005/driver_state.json: corrupt: not JSON" in msg
    assert "iter_0000003 is intact: resume from it with --ckpt-step 3" in msg
    assert resolve_checkpoint(str(tmp_path), step=3).endswith("iter_0000003")
    with pytest.raises(CheckpointLoadError, match="--ckpt-step 9: .*does not exist"):
        resolve_checkpoint(str(tmp_path), step=9)


def test_data_contract_change_is_refused(base_args):
    saved = data_contract(base_args)
    check_data_contract(saved, base_args)
    check_data_contract(None, base_args.replace(n_samples_per_prompt=3))  # checkpoints from before the contract
    with pytest.raises(CheckpointLoadError, match="--n-samples-per-prompt was 1, now 3"):
        check_data_contract(saved, base_args.replace(n_samples_per_prompt=3))
    with pytest.raises(CheckpointLoadError, match="--rollout-batch-size was 1, now 4"):
        check_data_contract(saved, base_args.replace(rollout_batch_size=4))


def test_truncate_jsonl_keeps_rows_up_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (-1, 0, 1, 2, 3)) + '{"step": 4, "x"')
    assert truncate_jsonl(str(path), "step", 1) == 3  # steps 2, 3 and the torn line
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [-1, 0, 1]
    assert truncate_jsonl(str(path), "step", 1) == 0
