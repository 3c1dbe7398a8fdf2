"""Our client's real calls against SGLang's own code, at every version we support (`pytest -m sglang_contract`)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests
import torch

from test_fsdp_helpers import make_args, make_model_dir

from slime.utils import sglang_versions as versions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import sglang_contract_env  # noqa: E402

pytestmark = pytest.mark.sglang_contract
VERSIONS = versions.CONTRACT_VERSIONS
STARTUP_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RealSGLang:
    """One SGLang version's server process (tests/sglang_real_server.py)."""

    def __init__(self, version: str, log_dir: str, abort_rounds: int = 2):
        self.version = version
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"sglang-{version}.log")
        cmd = [sys.executable, os.path.join(REPO, "tests", "sglang_real_server.py"), "--port", str(self.port),
               "--abort-rounds", str(abort_rounds)]
        for d in sglang_contract_env.site_dirs(version):
            cmd += ["--site", d]
        env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, deadline: float) -> "RealSGLang":
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if requests.get(self.url + "/_contract/state", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"SGLang {self.version}'s server did not come up; last lines of {self.log_path}:\n"
                           + "".join(open(self.log_path).readlines()[-40:]))

    def state(self) -> dict:
        return requests.get(self.url + "/_contract/state", timeout=10).json()

    def loaded(self) -> dict:
        return requests.get(self.url + "/_contract/loaded", timeout=30).json()

    def set_running(self, n: int) -> None:
        requests.post(self.url + "/_contract/running", json={"n": n}, timeout=10).raise_for_status()

    def reset(self) -> None:
        requests.post(self.url + "/_contract/reset", timeout=10).raise_for_status()
        self.set_running(0)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def sglang_servers(tmp_path_factory):
    missing = [v for v in VERSIONS if not sglang_contract_env.is_installed(v)]
    if missing:
        msg = (f"SGLang {', '.join(missing)} not installed for the contract tests: run "
               f"`python tools/sglang_contract_env.py install` (scripts/test.sh does)")
        if os.environ.get("SLIME_REQUIRE_SGLANG_CONTRACT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    log_dir = str(tmp_path_factory.mktemp("sglang_contract"))
    servers = {v: RealSGLang(v, log_dir) for v in VERSIONS}  # both import at once
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for s in servers.values():
            s.wait_ready(deadline)
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(params=VERSIONS)
def sglang(request, sglang_servers) -> RealSGLang:
    server = sglang_servers[request.param]
    server.reset()
    assert server.state()["version"] == request.param
    return server


# --- the trainer's weight updates -------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A tiny FSDP trainer (gloo, one rank); each test gives it the WeightUpdater of the mode it tests."""
    from slime.backends.fsdp_utils.actor import FSDPTrainer

    model_dir = make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))
    t = FSDPTrainer(make_args(model_dir))
    t.init()
    yield t
    t.shutdown()


def _use_mode(trainer, mode: str):
    from slime.backends.fsdp_utils.update_weight import FSDPWeightUpdater

    if trainer.updater is not None:
        trainer.updater.close()
    trainer.updater = FSDPWeightUpdater(trainer.args.replace(update_weight_mode=mode), trainer.model, 0)
    trainer.updater.timeout = 60.0  # a group that never forms fails the test within a minute, not ten
    return trainer.updater


def _digest(named) -> dict:
    out = {}
    for name, t in named:
        t = t.detach().cpu().contiguous()
        out[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                     "sha256": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()}
    return out


def _expected(trainer) -> dict:
    from slime.backends.fsdp_utils.hf_weights import iter_full_weights

    return _digest(iter_full_weights(trainer.model))


def test_distributed_update_reaches_sglang_bit_identical(sglang, trainer):
    """SGLang joins our group (its init_custom_process_group) and loads every bucket inside a session."""
    updater = _use_mode(trainer, "distributed")
    assert updater.buffer_bytes < 1 << 15  # several buckets
    metrics = trainer.update_weights([sglang.url], 3)
    state = sglang.state()
    assert state["groups"] == ["weight_update_group"]
    assert state["weight_version"] == "3"
    assert not state["session_open"]  # opened and closed around the buckets (0.5.21+)
    assert state["loads"] > 1
    assert sglang.loaded() == _expected(trainer)
    assert metrics["weight_sync_bytes"] > 0 and metrics["weight_sync_from_disk"] == 0.0
    # a second update reuses the group
    trainer.update_weights([sglang.url], 4)
    assert sglang.state()["weight_version"] == "4"
    trainer.updater.close()  # destroys the group on both sides
    assert sglang.state()["groups"] == []


def test_tensor_update_reaches_sglang_bit_identical(sglang, trainer):
    """/update_weights_from_tensor through SGLang's normalizer, unpickler and FlattenedTensorBucket, in a session."""
    _use_mode(trainer, "tensor")
    metrics = trainer.update_weights([sglang.url], 5)
    state = sglang.state()
    assert state["weight_version"] == "5" and not state["session_open"]
    assert sglang.loaded() == _expected(trainer)
    assert metrics["weight_sync_tensor"] == 1.0
    assert state["flushes"] == 1  # once per update, not once per bucket


def test_an_update_left_open_by_a_crashed_trainer_is_closed_first(sglang, trainer):
    """A session a previous (killed) trainer left open does not block the next update."""
    if versions.version_key(sglang.version) < (0, 5, 21, 0):
        pytest.skip("no weight-update sessions before SGLang 0.5.21")
    r = requests.post(sglang.url + "/begin_weight_update", json={}, timeout=30)
    assert r.status_code == 200, r.text
    _use_mode(trainer, "tensor")
    trainer.update_weights([sglang.url], 6)
    assert sglang.state()["weight_version"] == "6" and not sglang.state()["session_open"]


def test_disk_update_is_accepted(sglang, trainer, tmp_path):
    _use_mode(trainer, "disk")
    trainer.update_weights([sglang.url], 7)
    state = sglang.state()
    assert state["weight_version"] == "7" and len(state["disk_loads"]) == 1
    assert not state["session_open"]  # SGLang needs no session to load from disk


# --- the rollout side: EngineGroup's fan-outs, idleness, the version check -------------------------------
@pytest.fixture
def group(sglang, base_args, monkeypatch):
    """An EngineGroup whose router lists the SGLang server (the fan-out code is the group's own)."""
    import types

    from slime.backends.sglang_utils.engine_group import EngineGroup

    g = EngineGroup(base_args)
    monkeypatch.setattr(g, "worker_urls", lambda timeout=10.0: [sglang.url])
    # /flush_cache: the router fans it out as is; a live process (problem() None), as Router.problem answers
    g.router = types.SimpleNamespace(url=sglang.url, problem=lambda: None)
    yield g
    g.fan_out.close()


def test_abort_until_idle_reads_sglang_loads(sglang, group, caplog):
    """After abort_all the group polls SGLang's load report until no request runs or waits."""
    sglang.set_running(3)
    with caplog.at_level(logging.INFO, logger="slime.backends.sglang_utils.engine_group"):
        asyncio.run(group.abort_all_until_idle(timeout=30.0, interval=0.01))  # past 30 s it raises instead
    state = sglang.state()
    assert state["running"] == 0 and state["aborts"] >= 2
    idle = re.search(r"abort_all_until_idle: 1 worker\(s\) idle after (\d+) round\(s\)", caplog.text)
    assert idle and int(idle[1]) >= 2, caplog.text  # it returned because SGLang's load report said idle


def test_engine_load_counts_running_and_waiting(sglang, group):
    from slime.backends.sglang_utils.engine_api import busy_requests, load_sync

    sglang.set_running(4)
    assert busy_requests(load_sync(sglang.url)) == 4


def test_flush_cache_accepts_sglang_text_reply(sglang, group):
    """Finding 4: /flush_cache answers plain text."""
    group.flush_cache()
    assert sglang.state()["flushes"] == 1
    sglang.set_running(1)
    from slime.backends.sglang_utils.http_client import EngineHTTPError

    with pytest.raises(EngineHTTPError, match="HTTP 400"):
        group.flush_cache()


def test_pause_and_continue_are_accepted(sglang, group):
    for mode in ("in_place", "retract", "abort"):
        asyncio.run(group.pause(mode))
        assert sglang.state()["paused"] is True
        asyncio.run(group.continue_generation())
        assert sglang.state()["paused"] is False


def test_engine_version_is_read_and_accepted(sglang):
    from slime.backends.sglang_utils.engine_api import check_engine_versions

    assert check_engine_versions([sglang.url]) == {sglang.url: sglang.version}


def test_rollout_generate_payload_is_accepted(sglang, base_args):
    """The rollout's /generate body through SGLang's route, its request type and normalizer."""
    import aiohttp

    from slime.backends.sglang_utils import http_client
    from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
    from slime.utils.types import Sample

    args = base_args.replace(rollout_stop=["</s>"], rollout_stop_token_ids=[2], rollout_max_response_len=5)

    async def main():
        async with aiohttp.ClientSession() as session:
            req = SampleRequester(args, session, sglang.url, sampling_params_from_args(args), 0, 0)
            sample = Sample(index=0, group_index=0, tokens=[1, 2, 3], reward=0.0)
            payload = req.payload(sample)
            return payload, await http_client.generate(session, sglang.url, payload, timeout=30)

    payload, out = asyncio.run(main())
    (seen,) = sglang.state()["generate"]
    assert seen["rid"] == payload["rid"] and seen["input_ids"] == [1, 2, 3] and seen["return_logprob"] is True
    assert seen["sampling_params"]["max_new_tokens"] == 5 and seen["sampling_params"]["stop"] == ["</s>"]
    assert out["meta_info"]["id"] == payload["rid"]
