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

    with pytest.raises(RuntimeError):
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


def test_load_of_a_converted_model_checkpoint_says_ref_load(tmp_path):
    (tmp_path / "iter_0000000").mkdir()
    (tmp_path / "iter_0000000" / "metadata.json").write_text("{}")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("0")
    with pytest.raises(FileNotFoundError, match="torch_dist checkpoint.*--ref-load"):
        latest_checkpoint(str(tmp_path))
