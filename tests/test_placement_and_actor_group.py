"""Placement groups, RayTrainGroup's SPMD calls and timeouts, and FSDP at world size 2 == world size 1."""

from __future__ import annotations

import copy
import os
import re
import time

import pytest
import torch

from test_fsdp_helpers import make_args, make_groups, make_model_dir, model_log_probs

from slime.backends.fsdp_utils.actor import FSDPTrainer
from slime.ray.actor_group import RayTrainGroup, trainer_class, wait_ranks
from slime.ray.placement_group import PlacementError, bundle_plan, create_placement_groups, remove_placement_groups
from slime.utils.run import init_ray
from slime.utils.types import Sample, Status

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    if ray.is_initialized():  # a session another module of this worker left has other CPUs than these tests need
        ray.shutdown()
    init_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


def test_bundle_plan_follows_hardware_and_colocation(model_dir):
    args = make_args(model_dir, actor_num_gpus_per_node=2, rollout_num_gpus=3, colocate=False)
    bundles, actor, rollout = bundle_plan(args, use_gpu=False)
    assert bundles == [{"CPU": 1.0}] * 5 and actor == [0, 1] and rollout == [2, 3, 4]
    bundles, _, _ = bundle_plan(args, use_gpu=True)
    assert all(b["GPU"] == 1 for b in bundles)
    colo = args.replace(colocate=True)
    bundles, actor, rollout = bundle_plan(colo, use_gpu=False)
    assert len(bundles) == 2 and rollout == actor == [0, 1]


def test_cpu_placement_group_is_ready_and_never_asks_for_gpu(ray_session, model_dir):
    args = make_args(model_dir, actor_num_gpus_per_node=2, rollout_num_gpus=1)
    pgs = create_placement_groups(args, timeout_s=30)
    try:
        assert not pgs.use_gpu
        assert pgs.actor_bundles == [0, 1] and pgs.rollout_bundles == [2]
        assert all("GPU" not in b for b in pgs.pg.bundle_specs)
    finally:
        remove_placement_groups(pgs)
    too_big = make_args(model_dir, actor_num_gpus_per_node=8, rollout_num_gpus=8)
    with pytest.raises(PlacementError, match="--actor-num-gpus-per-node") as e:
        create_placement_groups(too_big, timeout_s=5)
    # what was asked for, and what the cluster has, node by node
    assert ("asks for 8 trainer + 8 rollout bundle(s) of {CPU: 1} = {CPU: 16} but the cluster has {CPU: 4} "
            "(node 127.0.0.1 (") in str(e.value) and re.search(r"CPU [0-4]/4 free, GPU 0/0 free", str(e.value))


def test_a_placement_group_that_cannot_be_ready_names_what_is_free(ray_session, model_dir):
    from ray.util.placement_group import placement_group

    holder = placement_group([{"CPU": 1.0}] * 3)  # another job holds 3 of the 4 CPUs
    ray.get(holder.ready(), timeout=30)
    try:
        args = make_args(model_dir, actor_num_gpus_per_node=1, rollout_num_gpus=1)
        # the holder keeps the group from ever being ready, so only create_placement_groups' own deadline ends
        # the wait, and the error says so
        with pytest.raises(PlacementError, match=r"not ready after 2s: it asks for 1 trainer \+ 1 rollout bundle\(s\) "
                                                 r"of \{CPU: 1\} = \{CPU: 2\}; the cluster has node 127.0.0.1 "
                                                 r"\(\w+\): CPU 1/4 free"):
            create_placement_groups(args, timeout_s=2)
    finally:
        ray.util.remove_placement_group(holder)


def test_engine_slots_take_the_rollout_bundles(ray_session, model_dir):
    args = make_args(model_dir, actor_num_gpus_per_node=1, rollout_num_gpus=2)
    pgs = create_placement_groups(args, timeout_s=30)
    try:
        slots = pgs.engine_slots(2, 1)
        here = ray.get_runtime_context().get_node_id()
        assert [s.bundle_indices for s in slots] == [(1,), (2,)] and all(s.node_id == here for s in slots)
        assert all(s.placement_group is pgs.pg and s.gpu_ids == () for s in slots)
        assert pgs.driver_node_id == here and pgs.node_ips == ["127.0.0.1"]
        with pytest.raises(PlacementError, match="3 engine"):
            pgs.engine_slots(3, 1)
    finally:
        remove_placement_groups(pgs)
    colocated = create_placement_groups(make_args(model_dir, actor_num_gpus_per_node=2, colocate=True), timeout_s=30)
    try:  # colocated: the engines take the trainers' bundles (issue 12 shares them per GPU)
        assert [s.bundle_index for s in colocated.engine_slots(2, 1)] == colocated.actor_bundles == [0, 1]
    finally:
        remove_placement_groups(colocated)


def test_trainer_class_follows_the_backend(model_dir):
    from slime.backends.megatron_utils.actor import MegatronTrainer

    assert trainer_class(make_args(model_dir)) is FSDPTrainer  # auto on CPU
    assert trainer_class(make_args(model_dir, "--train-backend", "megatron")) is MegatronTrainer


def test_wait_ranks_names_slow_and_failing_ranks(ray_session):
    @ray.remote(num_cpus=0)
    def work(rank: int, sleep: float, fail: bool = False):
        time.sleep(sleep)
        if fail:
            raise ValueError(f"boom on {rank}")
        return rank

    assert wait_ranks([work.remote(0, 0), work.remote(1, 0)], "x", timeout=30) == [0, 1]
    # rank 1 would answer only after the test's own timeout: wait_ranks raising at all is its deadline firing
    never = work.remote(1, 3600)
    try:
        with pytest.raises(TimeoutError, match=r"trainer rank\(s\) \[1\] did not answer within 2s"):
            wait_ranks([work.remote(0, 0), never], "trainer.train", timeout=2)
    finally:
        ray.cancel(never, force=True)
    with pytest.raises(RuntimeError, match=r"(?s)trainer rank 0 failed.*boom on 0"):
        wait_ranks([work.remote(0, 0, True), work.remote(1, 30)], "trainer.train", timeout=20)


def _run_group(args, groups, export_dir, engine=None):
    pgs = create_placement_groups(args, timeout_s=60)
    group = RayTrainGroup(args, pgs)
    try:
        assert group.init() is group and group.info["num_params"] > 0
        metrics = [group.train(i, copy.deepcopy(groups), i) for i in range(2)]
        group.export_hf(export_dir)
        group.save(export_dir + "_ckpt")
        if engine is not None:  # every rank takes part in the state-dict gather
            engine.wait_healthy()
            metrics.append(group.update_weights([engine.url], 2))
    finally:
        group.shutdown()
        remove_placement_groups(pgs)
    return metrics


@pytest.mark.slow
def test_world_size_two_matches_world_size_one(ray_session, model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from slime.backends.hf_engine.local_server import EngineServer

    groups = make_groups(seed=21)
    groups[1][2].status = Status.FAILED  # 7 samples: the ranks get unequal shares
    common = dict(lr=1e-2, micro_batch_size=1, global_batch_size=4, use_tis=True, entropy_coef=0.01)
    # world size 1 in this process (the reference), world size 2 as two Ray actors
    single = FSDPTrainer(make_args(model_dir, actor_num_gpus_per_node=1, **common))
    single.init()
    try:
        m1 = [single.train(i, copy.deepcopy(groups), i) for i in range(2)]
        single.export_hf(str(tmp_path / "ws1"))
        opt_ws1 = {k: {n: v.clone() for n, v in st.items()} for k, st in single.optimizer.state_dict()["state"].items()}
    finally:
        single.shutdown()
    engine = EngineServer(model_dir, ["--seed", "0"], log_path=str(tmp_path / "engine.log"))
    try:
        m2 = _run_group(make_args(model_dir, actor_num_gpus_per_node=2, **common), groups, str(tmp_path / "ws2"),
                        engine)
        sync = m2.pop()
        assert sync["weight_sync_from_disk"] == 0.0
        r = engine.post("/generate", {"input_ids": [1, 5, 6, 7], "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 6, "temperature": 1.0}}).json()
    finally:
        engine.stop()
    assert r["meta_info"]["weight_version"] == "2"
    out = r["meta_info"]["output_token_logprobs"]
    synced = Sample(index=0, tokens=[1, 5, 6, 7])
    synced.append_response([x[1] for x in out], [x[0] for x in out], 2)
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ws2"), dtype=torch.float32)
    want = model_log_probs(exported, synced)
    assert torch.allclose(torch.tensor(synced.rollout_log_probs), want, atol=1e-4)
    for a, b in zip(m1, m2):
        assert a["num_samples"] == b["num_samples"] == 7
        for key in ("loss", "pg_loss", "entropy", "pg_clipfrac", "grad_norm", "tis_ess", "ppo_kl"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
    assert m1[1]["ppo_kl"] != 0.0  # second rollout: old policy != behaviour
    w1 = load_file(os.path.join(tmp_path / "ws1", "model.safetensors"))
    w2 = load_file(os.path.join(tmp_path / "ws2", "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
    w0 = load_file(os.path.join(model_dir, "model.safetensors"))
    assert max(float((w1[k] - w0[k]).abs().max()) for k in w1) > 1e-3  # training moved the weights

    # a checkpoint saved at world size 2 loads at world size 1 (full state dicts keyed by name)
    resumed = FSDPTrainer(make_args(model_dir, actor_num_gpus_per_node=1, **common))
    resumed.init()
    try:
        resumed.load(str(tmp_path / "ws2") + "_ckpt")
        resumed.export_hf(str(tmp_path / "resumed"))
        opt = resumed.optimizer.state_dict()["state"]
    finally:
        resumed.shutdown()
    w3 = load_file(os.path.join(tmp_path / "resumed", "model.safetensors"))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)
    assert opt.keys() == opt_ws1.keys()
    for k in opt:
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = opt[k][name], opt_ws1[k][name]
            a = a.full_tensor() if hasattr(a, "full_tensor") else a
            b = b.full_tensor() if hasattr(b, "full_tensor") else b
            assert torch.allclose(a, b, atol=1e-6), (k, name)
