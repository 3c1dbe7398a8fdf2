"""Joining a cluster, without one."""

from __future__ import annotations

import json
import os

import pytest

from slime.utils.paths import PathNotVisibleError, path_problems, shared_marker
from slime.utils.run import RAY_JOB_CONFIG_ENV, job_runtime_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_job_runtime_env_carries_the_code_and_the_settings(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "rel/plugins" + os.pathsep + "/abs/lib")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.setenv("SOME_SECRET_TOKEN", "x")
    monkeypatch.delenv(RAY_JOB_CONFIG_ENV, raising=False)
    env = job_runtime_env()["env_vars"]
    assert env["PYTHONPATH"].split(os.pathsep) == [REPO, str(tmp_path), str(tmp_path / "rel/plugins"), "/abs/lib"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["NCCL_IB_HCA"] == "mlx5_0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "SOME_SECRET_TOKEN" not in env and not any(k.startswith("RAY_") for k in env)
    assert "GLOO_SOCKET_IFNAME" not in job_runtime_env("auto")["env_vars"] or os.environ.get("GLOO_SOCKET_IFNAME")
    pinned = job_runtime_env("lo")["env_vars"]  # an interface name pins the collectives too
    assert pinned["GLOO_SOCKET_IFNAME"] == "lo" and pinned["NCCL_SOCKET_IFNAME"] == "lo"
    # under `ray job submit` the job's runtime_env wins: Ray refuses a key set twice
    monkeypatch.setenv(RAY_JOB_CONFIG_ENV, json.dumps({"runtime_env": {"env_vars": {"NCCL_IB_HCA": "mlx5_1"},
                                                                        "working_dir": "/job/code"}}))
    env = job_runtime_env()["env_vars"]
    assert "NCCL_IB_HCA" not in env and "PYTHONPATH" not in env and env["HF_HUB_OFFLINE"] == "1"


def test_path_problems_say_what_a_node_cannot_see(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text("")
    save = tmp_path / "save"
    save.mkdir()
    ok = [("--hf-checkpoint", str(model), "hf_dir"), ("--prompt-data", str(tmp_path / "data.jsonl"), "file"),
          ("--load", str(save), "dir")]
    assert path_problems(ok) == []
    with shared_marker(str(save)) as marker:
        assert (save / marker).is_file()
        assert path_problems([("--save", str(save), f"shared:{marker}")]) == []
        other = tmp_path / "other_save"  # the same path on another node, but not the driver's directory
        other.mkdir()
        assert path_problems([("--save", str(other), f"shared:{marker}")]) == [
            f"--save {other}: exists here but is not the driver's directory (a file the driver wrote there is missing)"]
    assert not (save / marker).exists()
    assert path_problems([("--hf-checkpoint", str(tmp_path / "nope"), "hf_dir"),
                          ("--hf-checkpoint", str(save), "hf_dir")]) == [
        f"--hf-checkpoint {tmp_path / 'nope'}: not found", f"--hf-checkpoint {save}: no config.json"]
    with pytest.raises(ValueError, match="unknown kind"):
        path_problems([("--x", str(save), "socket")])


def test_an_engine_host_names_its_node_when_it_cannot_see_the_model(base_args, tmp_path):
    from slime.backends.sglang_utils.engine_host import EngineHost

    host = EngineHost(base_args.replace(hf_checkpoint=str(tmp_path / "not_shared"), rollout_backend="embedded"), 0,
                      str(tmp_path))
    with pytest.raises(PathNotVisibleError, match=r"engine 0 on node \S+: --hf-checkpoint .*not_shared: not found "
                                                  r"\(multi-node runs need shared storage"):
        host.start()
    assert host.problem() is None and host.engine is None  # nothing was launched
