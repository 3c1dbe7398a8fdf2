"""Trainer → real embedded engine weight sync: the broadcast group (gloo) and
the disk path, from the FSDP and the Megatron trainer (HF names, buckets).
After a sync the engine's sampled-token log-probs equal the trainer's
teacher-forced ones and the engine reports the new version."""

from __future__ import annotations

import pytest
import torch

from sglang_format_reader import ReaderServer
from test_fsdp_helpers import make_args, make_groups

from slime.backends.fsdp_utils.actor import FSDPTrainer
from slime.backends.training_utils.data import flatten_groups
from slime.utils.types import Sample

torch.set_num_threads(1)
PROMPT = [1, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def engine(model_dir, start_engine):
    return start_engine(model_dir, "--seed", "0")


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
def trainer(make_trainer):
    return lambda backend="fsdp", **over: make_trainer(backend, **{"lr": 1e-2, **over})


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
    t = trainer(backend, update_weight_mode="disk")
    start = int(engine_version(engine))
    m = _train_then_sync(t, engine, start + 1)
    assert m["weight_sync_from_disk"] == 1.0


def test_unreachable_engine_is_named(trainer):
    t = trainer(update_weight_mode="disk")
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
    while engine.load()["num_running_reqs"] < 1 and time.monotonic() < deadline:
        time.sleep(0.002)  # running: it has KV to keep
    engine.post("/abort_request", {"abort_all": True})
    t.join(30)
    assert box["r"].status_code == 200, box["r"].text
    assert box["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    return engine.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"]


@pytest.mark.parametrize("flush", [True, False])
def test_weight_sync_flushes_the_cache_as_the_rollout_says(engine, trainer, flush):
    """A flushing update drops the aborted requests' KV (computed by the old weights), so resumed samples are
    re-prefilled; `flush_cache=False` (the rollout's rule under --reuse-stale-kv or in-place pauses: tests/
    test_simulator.py checks it) keeps it."""
    engine.post("/flush_cache")
    t = trainer(update_weight_mode="disk")
    assert _park_one_aborted_request(engine) >= 1
    t.update_weights([engine.url], int(engine_version(engine)) + 1, flush_cache=flush)
    left = engine.get("/get_server_info").json()["internal_states"][0]["prefix_cache_entries"]
    assert (left == 0) if flush else (left >= 1)


# ---- --update-weight-mode tensor ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_tensor_sync_to_the_engine(engine, trainer, backend):
    """Shared memory on CPU (CUDA IPC handles on a GPU): the engine serves the trained weights."""
    t = trainer(backend, update_weight_mode="tensor")  # 16 KiB buckets: several POSTs
    start = int(engine_version(engine))
    m = _train_then_sync(t, engine, start + 1)
    assert m["weight_sync_tensor"] == 1.0 and m["weight_sync_bytes"] > 1 << 14
    _train_then_sync(t, engine, start + 2)


def trainer_hf_weights(t) -> dict[str, torch.Tensor]:
    if isinstance(t, FSDPTrainer):
        from slime.backends.fsdp_utils.hf_weights import full_state_dict

        return {k: v.clone() for k, v in full_state_dict(t.model).items()}
    from slime.backends.megatron_utils.update_weight import gather_hf_weights

    return dict(gather_hf_weights(t.actor, t.layout))


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_tensor_payload_read_by_an_independent_sglang_reader(trainer, backend, tmp_path):
    reader = ReaderServer(tmp_path)
    try:
        t = trainer(backend, update_weight_mode="tensor")
        t.train(0, make_groups(seed=3), 0)
        t.update_weights([reader.url], 5)
        buckets, reqs = reader.received()
    finally:
        reader.stop()
    assert len(buckets) == len(reqs) > 1  # --update-weight-buffer-size 16 KiB
    got: dict[str, torch.Tensor] = {}
    for per_rank in buckets:
        assert len(per_rank) == 1  # one TP rank
        got.update(per_rank[0])
    want = trainer_hf_weights(t)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # the flush comes once, with the last bucket (SGLang flushes after that load)
    assert [r["flush_cache"] for r in reqs] == [False] * (len(reqs) - 1) + [True]
    for r in reqs:
        assert (r["load_format"], r["weight_version"], r["entries"]) == ("flattened_bucket", "5", 1)
        assert set(r["globals"]) <= {"torch.multiprocessing.reductions.rebuild_tensor",
                                     "torch.multiprocessing.reductions.rebuild_typed_storage",
                                     "torch.multiprocessing.reductions.rebuild_storage_filename", "torch.Tensor",
                                     "torch.storage.UntypedStorage", "torch.Size", "torch.float32",
                                     "types.SimpleNamespace"}, r["globals"]


def _feed_two_ranks(rank, world, out_dir, model_dir, port, urls):
    """Each of 2 FSDP ranks feeds the engine on 'its device' (engines 0 and 1), then both feed one TP-2 engine."""
    from slime.backends.training_utils.weight_sync.feed import EngineFeed

    args = make_args(model_dir, "--train-backend", "fsdp", lr=1e-2, update_weight_mode="tensor")
    t = FSDPTrainer(args, rank, world)
    t.init("127.0.0.1", port)
    try:
        t.train(0, make_groups(seed=5), 0)
        t.update_weights(urls[:2], 4, [EngineFeed(urls[0], (0,)), EngineFeed(urls[1], (1,))])
        t.update_weights(urls[2:], 5, [EngineFeed(urls[2], (1, 0))])  # TP rank 0 on trainer rank 1's device
        want = trainer_hf_weights(t)  # collective
        if rank == 0:
            torch.save(want, f"{out_dir}/want.pt")
    finally:
        t.shutdown()
    open(f"{out_dir}/done{rank}", "w").close()


def test_tensor_sync_each_rank_feeds_the_engine_on_its_device(model_dir, tmp_path):
    """The GPU plan on CPU: every trainer rank gathers the full weights and hands them to its own engine; a
    TP-2 engine gets its two entries (one per TP rank) gathered from the two trainer ranks, in TP order."""
    from megatron_helpers import free_port, spawn

    import threading
    import time

    readers = [ReaderServer(tmp_path / f"reader{i}") for i in range(3) if (tmp_path / f"reader{i}").mkdir() is None]
    ranks_dir, box = tmp_path / "ranks", {}

    def run():
        try:
            spawn(_feed_two_ranks, 2, str(ranks_dir), model_dir, free_port(), [r.url for r in readers])
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    runner = threading.Thread(target=run)
    runner.start()
    try:
        # a rank's exit is seen once torch's shared-memory manager, which it started (and which inherited the
        # rank's exit pipe), ends: that is when the readers, its last clients, are gone
        deadline = time.monotonic() + 500
        while not all((ranks_dir / f"done{r}").exists() for r in range(2)) and runner.is_alive():
            assert time.monotonic() < deadline, "ranks did not finish"
            time.sleep(0.2)
        got = [r.received() for r in readers]
    finally:
        for r in readers:
            r.stop()
        runner.join(120)
    assert "error" not in box, box.get("error")
    want = torch.load(tmp_path / "ranks" / "want.pt")
    for i, (buckets, reqs) in enumerate(got):
        tp = 2 if i == 2 else 1
        assert all(r["entries"] == tp for r in reqs) and {r["weight_version"] for r in reqs} == {"5" if tp == 2 else "4"}
        for rank_entry in range(tp):
            received = {k: v for per_rank in buckets for k, v in per_rank[rank_entry].items()}
            assert received.keys() == want.keys()
            assert all(torch.equal(received[k], want[k]) for k in want), f"engine {i}, TP rank {rank_entry}"


def test_cuda_buckets_release_their_ipc_handles_after_the_reply(monkeypatch):
    """SGLang expects a sender to call torch.cuda.ipc_collect() once the engine has replied to a bucket shared
    by CUDA IPC handle (otherwise the memory stays allocated until the process ends); CPU buckets have none."""
    from slime.backends.training_utils.weight_sync import tensor as update_weight_tensor

    calls = []
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: calls.append(1))
    update_weight_tensor.release_ipc_handles(torch.device("cpu"))
    assert calls == []
    update_weight_tensor.release_ipc_handles(torch.device("cuda", 0))
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_sender_on_cuda_returns_the_bucket_memory(tmp_path):
    """On a GPU: every bucket goes out as CUDA IPC handles to a reader in another process (read with an exact
    SGLang allow-list), the flush only with the last one, and once the reader has replied the sender's memory is
    back where it was (the bucket freed, its IPC handles collected)."""
    from slime.backends.training_utils.weight_sync.tensor import TensorSender
    from slime.backends.training_utils.weight_sync.feed import EngineFeed

    reader = ReaderServer(tmp_path)
    try:
        named = [(f"w{i}", torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)) for i in range(8)]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        sender = TensorSender(0, 1, None, 1 << 18, 120.0)  # 256 KiB buckets: 2 tensors each
        sender.send([EngineFeed(reader.url, (0,))], iter(named), 3)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base
        sender.close()
        buckets, reqs = reader.received()
    finally:
        reader.stop()
    assert len(reqs) == 4 and [r["flush_cache"] for r in reqs] == [False, False, False, True]
    got = {k: v for per_rank in buckets for k, v in per_rank[0].items()}
    assert all(torch.equal(got[k].cuda(), t) for k, t in named)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_payload_opens_in_another_process_without_a_copy(tmp_path):
    """On a GPU the payload carries CUDA IPC handles (device as the GPU's UUID): another process opens the
    trainer's memory, read both by the engine's reader and by the independent SGLang-format reader."""
    import subprocess
    import sys

    from slime.backends.training_utils.weight_sync.payload import flatten_bucket, serialize

    named = [("a", torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)),
             ("b", torch.randn(7, device="cuda", dtype=torch.bfloat16))]
    flat = flatten_bucket(named)
    payload = serialize(flat)
    code = f"""
import sys, torch
sys.path.insert(0, {str(__import__("os").path.dirname(__file__))!r})
from slime.backends.hf_engine.tensor_payload import decode
from sglang_format_reader import deserialize, reconstruct_bucket
ours = dict(decode([sys.argv[1]], "flattened_bucket"))
theirs = reconstruct_bucket(deserialize(sys.argv[1], []))
for n in ("a", "b"):
    assert ours[n].is_cuda and torch.equal(ours[n], theirs[n])
    print(n, float(ours[n].float().sum()))
ours["b"].fill_(1.0)  # the sender's memory, not a copy
torch.cuda.synchronize()
"""
    out = subprocess.run([sys.executable, "-c", code, payload], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    sums = dict(line.split() for line in out.stdout.splitlines())
    for n, t in named:
        assert abs(float(sums[n]) - float(t.float().sum())) < 1e-2
    assert torch.equal(flat["flattened_tensor"][-7:], torch.ones(7, device="cuda", dtype=torch.bfloat16))


def test_slime_disk_flag_replaced_without_the_mode_is_refused(model_dir):
    from slime.backends.training_utils.weight_sync import WeightUpdater

    args = make_args(model_dir)
    with pytest.raises(ValueError, match="update_weight_mode='disk'"):
        WeightUpdater(args.replace(update_weights_from_disk=True), torch.nn.Linear(1, 1), 0)
    WeightUpdater(args.replace(update_weights_from_disk=True, update_weight_mode="disk"), torch.nn.Linear(1, 1), 0).close()
