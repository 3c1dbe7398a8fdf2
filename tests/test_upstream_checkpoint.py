"""Checkpoints in upstream slime's layout."""

from __future__ import annotations

import io
import os
import random
from argparse import Namespace

import numpy as np
import pytest
import torch

from megatron_helpers import megatron_args
from test_fsdp_helpers import make_groups, model_log_probs

from slime.tasks import subtract_chain as task
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

pytestmark = pytest.mark.timeout(600)
SPEC = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, max_position_embeddings=256)
TRACKER = "latest_checkpointed_iteration.txt"


def write_upstream_checkpoint(hf_dir: str, root: str, iteration: int | None) -> str:
    """`hf_dir` as upstream slime saves it."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.transformer.enums import AttnBackend

    from slime.arguments import megatron_flags
    from slime.backends.megatron_utils import parallel
    from slime.backends.megatron_utils.convert import _init
    from slime.backends.megatron_utils.model import build_gpt, load_hf
    from slime.utils.model_shape import read_shape

    shape = read_shape(hf_dir)
    layout, owns = _init(1)
    try:
        built = build_gpt(megatron_flags([]), shape, 1, trainable=False, wrap_ddp=False)
        load_hf(built, hf_dir, 0, 1)
        metadata = {"singleton_local_shards": False, "distrib_optim_sharding_type": "dp_reshardable"}
        model = built.core.sharded_state_dict(prefix="", metadata=metadata)
        for layer in range(shape.num_layers):  # Transformer Engine's attention keeps an extra state per layer
            model[f"decoder.layers.{layer}.self_attention.core_attention._extra_state"] = ShardedObject(
                "decoder.layers.self_attention.core_attention._extra_state", io.BytesIO(),
                (shape.num_layers,), (layer,), replica_id=0)
        rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
               "torch_rng_state": torch.get_rng_state(),
               "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
        state = {"args": Namespace(hf_checkpoint=hf_dir, ckpt_format="torch_dist", params_dtype=torch.bfloat16,
                                   attention_backend=AttnBackend.auto, tensor_model_parallel_size=1,
                                   use_distributed_optimizer=True, iteration=iteration or 1),
                 "checkpoint_version": 3.0, "iteration": 1 if iteration is None else iteration, "model": model,
                 "rng_state": ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=0),
                 "num_floating_point_operations_so_far": 0}
        if iteration is not None:
            state["opt_param_scheduler"] = {"max_lr": 1e-6, "num_steps": 64 * iteration, "decay_style": "constant"}
        name = "release" if iteration is None else f"iter_{iteration:07d}"
        os.makedirs(os.path.join(root, name))
        dist_checkpointing.save(state, os.path.join(root, name), content_metadata=metadata)
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write("release" if iteration is None else str(iteration))
        return os.path.join(root, name)
    finally:
        parallel.destroy_parallel(owns)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The model the run is configured with (`--hf-checkpoint`) and another one, saved in upstream's layouts."""
    root = tmp_path_factory.mktemp("upstream_ckpt")
    tok = build_tokenizer(task.VOCAB)
    build_tiny_qwen3(str(root / "hf"), tok, SPEC, seed=3)
    build_tiny_qwen3(str(root / "other"), tok, SPEC, seed=4)
    write_upstream_checkpoint(str(root / "other"), str(root / "converted"), None)
    write_upstream_checkpoint(str(root / "other"), str(root / "trained"), 7)
    return root


def assert_log_probs_of(trainer, builts, model_dir: str, not_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from slime.backends.training_utils.data import flatten_groups

    want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    not_this = AutoModelForCausalLM.from_pretrained(not_dir, dtype=torch.float32)
    groups = make_groups(seed=5)
    samples = [s for g in groups for s in g]
    items = [it for g in flatten_groups(groups)[0] for it in g]
    for built in builts:
        for s, lp in zip(samples, trainer._log_probs(built, items)):
            assert torch.allclose(lp, model_log_probs(want, s), atol=1e-5)
            assert not torch.allclose(lp, model_log_probs(not_this, s), atol=1e-3)


def test_upstream_converter_output_is_a_ref_load(models):
    from slime.backends.megatron_utils.actor import MegatronTrainer

    t = MegatronTrainer(megatron_args(str(models / "hf"), "--ref-load", str(models / "converted"), "--use-kl-loss",
                                      "--kl-loss-coef", "0.1"))
    t.init()
    try:  # the reference model and the actor's starting point, as in slime
        assert_log_probs_of(t, (t.actor, t.ref), str(models / "other"), str(models / "hf"))
    finally:
        t.shutdown()


def test_load_resumes_the_weights_of_an_upstream_checkpoint(models):
    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.backends.megatron_utils.checkpoint import foreign_checkpoint

    converted, trained = foreign_checkpoint(str(models / "converted")), foreign_checkpoint(str(models / "trained"))
    assert (converted.model_dir, converted.start_rollout) == (str(models / "converted" / "release"), 0)
    assert (trained.model_dir, trained.start_rollout) == (str(models / "trained" / "iter_0000007"), 8)
    t = MegatronTrainer(megatron_args(str(models / "hf"), "--load", str(models / "trained"), "--use-kl-loss",
                                      "--kl-loss-coef", "0.1"))
    t.init()
    try:  # the actor resumes the checkpoint's weights; the reference stays --hf-checkpoint
        assert_log_probs_of(t, (t.actor,), str(models / "other"), str(models / "hf"))
        assert_log_probs_of(t, (t.ref,), str(models / "hf"), str(models / "other"))
    finally:
        t.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_py_resumes_an_upstream_training_checkpoint(models, tmp_path):
    """train.py --load UPSTREAM_SAVE."""
    import json
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    task.write_dataset(str(tmp_path / "train.jsonl"), 50, seed=1, cap=8)
    run = tmp_path / "run"
    cmd = [sys.executable, os.path.join(repo, "train.py"), "--train-backend", "megatron",
           "--hf-checkpoint", str(models / "hf"), "--load", str(models / "trained"),
           "--prompt-data", str(tmp_path / "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--rm-type", "subtract_chain", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "16", "--num-rollout", "9", "--lr", "1e-4", "--run-dir", str(run),
           "--no-use-wandb"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=800,
                          env={**os.environ, "PYTHONPATH": repo, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"--load {models / 'trained'} holds iter_0000007, not a train.py checkpoint (upstream slime's or a "
            "converter's): resuming its weights at rollout 8; its optimizer state, the buffer, the ledger and the data "
            "position start fresh") in proc.stderr
    steps = [json.loads(line)["step"] for line in open(run / "metrics.jsonl")]
    assert [s for s in steps if s >= 0] == [8]
