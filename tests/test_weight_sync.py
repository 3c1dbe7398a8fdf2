"""Trainer → real embedded engine weight sync: the broadcast group (gloo) and
the disk path, from the FSDP and the Megatron trainer (HF names, buckets).
After a sync the engine's sampled-token log-probs equal the trainer's
teacher-forced ones and the engine reports the new version."""

from __future__ import annotations

import pytest
import torch

from test_fsdp_helpers import make_args, make_groups, make_model_dir

from slime.backends.fsdp_utils.actor import FSDPTrainer
from slime.backends.training_utils.data import flatten_groups
from slime.backends.hf_engine.testing import EngineServer
from slime.utils.types import Sample

torch.set_num_threads(1)
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_log") / "engine.log"
    srv = EngineServer(model_dir, ["--seed", "0"], log_path=str(log)).wait_healthy()
    yield srv
    srv.stop()


def sample_from_engine(engine, n: int = 8) -> tuple[Sample, str]:
    r = engine.post("/generate", {"input_ids": PROMPT, "return_logprob": True,
                                  "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    lps = [x[0] for x in meta["output_token_logprobs"]]
    ids = [x[1] for x in meta["output_token_logprobs"]]
    s = Sample(index=0, group_index=0, tokens=list(PROMPT), reward=0.0)
    s.append_response(ids, lps, int(meta["weight_version"]))
    return s, meta["weight_version"]


def mismatch(trainer, s: Sample) -> float:
    items = [it for g in flatten_groups([[s]])[0] for it in g]
    policy = trainer.model if isinstance(trainer, FSDPTrainer) else trainer.actor
    lp = trainer._log_probs(policy, items)[0]
    return float((lp - torch.tensor(s.rollout_log_probs)).abs().max())


def engine_version(engine) -> str:
    return engine.get("/get_model_info").json()["weight_version"]


@pytest.fixture
def trainer(model_dir):
    made = []

    def _make(backend: str = "fsdp", **over):
        args = make_args(model_dir, "--train-backend", backend, lr=1e-2, **over)
        if backend == "fsdp":
            t = FSDPTrainer(args)
        else:
            from slime.backends.megatron_utils.actor import MegatronTrainer

            t = MegatronTrainer(args)
        t.init()
        made.append(t)
        return t

    yield _make
    for t in made:
        t.shutdown()


def _train_then_sync(t, engine, version: int) -> dict:
    t.train(version - 1, make_groups(seed=version), version - 1)
    stale, _ = sample_from_engine(engine)
    assert mismatch(t, stale) > 1e-3  # the engine still serves the old weights
    metrics = t.update_weights([engine.url], version)
    fresh, reported = sample_from_engine(engine)
    assert reported == str(version) == engine_version(engine)
    assert mismatch(t, fresh) <= 1e-4
    return metrics


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_distributed_sync_over_gloo(engine, trainer, backend):
    t = trainer(backend)  # --update-weight-buffer-size 16 KiB: several buckets
    start = int(engine_version(engine))
    m1 = _train_then_sync(t, engine, start + 1)
    assert m1["weight_sync_from_disk"] == 0.0 and m1["weight_sync_time_s"] > 0
    assert m1["weight_sync_bytes"] > 1 << 14
    m2 = _train_then_sync(t, engine, start + 2)  # the group is reused
    assert m2["weight_sync_from_disk"] == 0.0
    t.shutdown()  # releases the group on both sides
    assert engine.post("/destroy_weights_update_group", {"group_name": "weight_update_group"}).json()["success"] is False


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_disk_sync(engine, trainer, backend):
    t = trainer(backend, update_weights_from_disk=True)
    start = int(engine_version(engine))
    m = _train_then_sync(t, engine, start + 1)
    assert m["weight_sync_from_disk"] == 1.0


def test_unreachable_engine_is_named(trainer):
    t = trainer(update_weights_from_disk=True)
    with pytest.raises(RuntimeError, match="127.0.0.1:9"):
        t.update_weights(["http://127.0.0.1:9"], 1)


def _park_one_aborted_request(engine) -> int:
    """Start a long request, abort it mid-way: the engine keeps its KV (for the request resuming it)."""
    import threading
    import time

    box = {}
    t = threading.Thread(target=lambda: box.update(r=engine.post("/generate", {
        "input_ids": PROMPT, "rid": "to-park", "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})))
    t.start()
    deadline = time.monotonic() + 30
    while engine.get("/get_load").json()[0]["num_reqs"] < 1 and time.monotonic() < deadline:
        time.sleep(0.002)  # running: it has KV to keep
    engine.post("/abort_request", {"abort_all": True})
    t.join(30)
    assert box["r"].status_code == 200, box["r"].text
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    return engine.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"]


@pytest.mark.parametrize("reuse", [False, True])
def test_weight_sync_flushes_the_cache_unless_reuse_stale_kv(engine, trainer, reuse):
    """Default: an update flushes the aborted requests' KV (computed by the old weights), so resumed samples
    are re-prefilled; --reuse-stale-kv sends flush_cache=false and the engine keeps it."""
    engine.post("/flush_cache")
    t = trainer(update_weights_from_disk=True, reuse_stale_kv=reuse)
    assert _park_one_aborted_request(engine) >= 1
    t.update_weights([engine.url], int(engine_version(engine)) + 1)
    left = engine.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"]
    assert (left >= 1) if reuse else (left == 0)
