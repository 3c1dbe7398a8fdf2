"""--hf-checkpoint is checked before anything loads it: the missing or corrupt file is named."""

import pytest

from test_fsdp_helpers import make_model_dir

from slime.utils.hf_dir import ModelDirError, check_hf_checkpoint, max_positions


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("hf_dir") / "model")


def test_a_real_model_dir_passes_and_gives_its_context_length(model):
    config = check_hf_checkpoint(model)
    assert max_positions(config) == 128
    assert max_positions(config, {"context-length": "64"}) == 64  # --sglang-context-length wins


def test_not_a_model_dir_is_named(tmp_path, model):
    (tmp_path / "data.jsonl").write_text("{}")
    with pytest.raises(ModelDirError, match=r"--hf-checkpoint .*: not a Hugging Face model directory \(no config.json; it holds data.jsonl\)"):
        check_hf_checkpoint(str(tmp_path))
    with pytest.raises(ModelDirError, match="is not a directory"):
        check_hf_checkpoint(str(tmp_path / "data.jsonl"))


def test_corrupt_config_or_weights_are_named(tmp_path, model):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelDirError, match=r"config.json: corrupt: not JSON"):
        check_hf_checkpoint(str(bad))
    shutil.copy(f"{model}/config.json", bad / "config.json")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ModelDirError, match=r"model.safetensors: (truncated|corrupt)"):
        check_hf_checkpoint(str(bad))
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelDirError, match=r"no weight files"):
        check_hf_checkpoint(str(bad), flag="--ref-load")
