"""Checkpoints load without running code."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from test_fsdp_helpers import make_args, make_model_dir

from slime.backends.fsdp_utils import checkpoint as ckpt
from slime.backends.fsdp_utils.actor import FSDPTrainer
from slime.utils.safe_load import CheckpointFileError, check_safetensors, read_json_file, safe_torch_load

torch.set_num_threads(1)


class Payload:
    """Unpickling this runs `touch <marker>` (what a planted checkpoint would do)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One real trainer checkpoint (model.safetensors, optimizer.pt, rng_rank0.json) and the trainer."""
    root = tmp_path_factory.mktemp("safe_load")
    trainer = FSDPTrainer(make_args(make_model_dir(root / "model")))
    trainer.init()
    trainer.save(str(root / "ckpt"))
    yield trainer, root / "ckpt"
    trainer.shutdown()


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_planted_optimizer_file_is_refused_and_runs_nothing(saved, tmp_path):
    trainer, good = saved
    bad = _copy(good, tmp_path / "planted")
    marker = tmp_path / "PAYLOAD_RAN"
    torch.save({"state": {}, "param_groups": [], "x": Payload(str(marker))}, bad / "optimizer.pt")
    with pytest.raises(CheckpointFileError) as err:
        trainer.load(str(bad))
    assert "optimizer.pt" in str(err.value) and "refused" in str(err.value)
    assert "system" in str(err.value)  # names what it would have called
    assert not marker.exists()
    trainer.load(str(good))  # the trainer is still usable: the intact checkpoint loads


def test_planted_legacy_rng_file_is_refused(saved, tmp_path):
    trainer, good = saved
    bad = _copy(good, tmp_path / "planted_rng")
    os.remove(bad / "rng_rank0.json")
    marker = tmp_path / "RNG_PAYLOAD_RAN"
    torch.save({"python": Payload(str(marker))}, bad / "rng_rank0.pt")
    with pytest.raises(CheckpointFileError, match="rng_rank0.pt.*refused"):
        trainer.load(str(bad))
    assert not marker.exists()


def test_legacy_pickled_rng_state_still_loads(saved, tmp_path):
    trainer, good = saved
    old = _copy(good, tmp_path / "legacy")
    os.remove(old / "rng_rank0.json")
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    torch.save({"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()},
               old / "rng_rank0.pt")  # the format written before the RNG state became JSON
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    trainer.load(str(old))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_corrupt_files_are_named(saved, tmp_path):
    trainer, good = saved
    bad = _copy(good, tmp_path / "truncated")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointFileError, match=r"model\.safetensors: truncated"):
        trainer.load(str(bad))
    with pytest.raises(CheckpointFileError, match="truncated"):
        check_safetensors(str(bad / "model.safetensors"))

    (tmp_path / "garbage.pt").write_bytes(b"\x00not a checkpoint" * 20)
    with pytest.raises(CheckpointFileError, match="garbage.pt: not a torch checkpoint"):
        safe_torch_load(str(tmp_path / "garbage.pt"))
    (tmp_path / "state.json").write_text('{"rollout_id": 3')
    with pytest.raises(CheckpointFileError, match="state.json: corrupt: not JSON"):
        read_json_file(str(tmp_path / "state.json"))


def test_rng_state_is_json_not_pickle(saved):
    _, good = saved
    assert not os.path.exists(good / "rng_rank0.pt")
    state = json.loads((good / "rng_rank0.json").read_text())
    assert set(state) >= {"python", "numpy", "torch"}
    assert ckpt.read_rng_file(str(good), 0) == state


def test_driver_refuses_a_planted_checkpoint_before_loading_anything(saved, tmp_path):
    from slime.utils.checkpoint import CheckpointLoadError, resolve_checkpoint, save_checkpoint
    import shutil

    _, good = saved
    save_dir = tmp_path / "save"

    def trainer(d):
        shutil.copytree(good, d, dirs_exist_ok=True)

    def buffer(d):
        with open(os.path.join(d, "buffer.json"), "w") as f:
            f.write("{}")

    for rid in (1, 2):
        save_checkpoint(str(save_dir), rid, {"trainer": trainer, "buffer": buffer},
                        {"rollout_id": rid, "rollout": {}, "rng": {}})
    marker = tmp_path / "PLANTED_RAN"
    torch.save({"state": Payload(str(marker))}, save_dir / "iter_0000002" / "trainer" / "optimizer.pt")
    with pytest.raises(CheckpointLoadError) as err:
        resolve_checkpoint(str(save_dir))
    msg = str(err.value)
    assert "iter_0000002/trainer/optimizer.pt: refused to load" in msg and "system" in msg
    assert "iter_0000001 is intact: resume from it with --ckpt-step 1" in msg
    assert not marker.exists()


def test_planted_dist_checkpoint_metadata_is_refused(tmp_path):
    """torch.distributed.checkpoint (Megatron's torch_dist) unpickles `.metadata` with plain pickle."""
    import pickle

    from torch.distributed.checkpoint import FileSystemWriter, save

    from slime.utils.safe_load import check_dist_checkpoint

    good = tmp_path / "torch_dist"
    save({"w": torch.ones(2, 3), "step": 3}, storage_writer=FileSystemWriter(str(good)), no_dist=True)
    check_dist_checkpoint(str(good))
    marker = tmp_path / "METADATA_PAYLOAD_RAN"
    with open(good / ".metadata", "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises(CheckpointFileError, match=r"\.metadata: refused to load: it needs posix\.system"):
        check_dist_checkpoint(str(good))
    assert not marker.exists()
