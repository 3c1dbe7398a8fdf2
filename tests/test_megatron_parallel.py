"""The Megatron trainer across layouts on CPU (gloo): TP=2 matches HF and
TP=1 (logits, loss, gradients; with sequence parallelism and token-budget
micro-batches too; packed and padded micro-batches alike), and checkpoints resume exactly at another
TP / DP (weights bit-equal, the next step equal), with the distributed and
the plain optimizer; with the distributed optimizer's overlapped gather, the weights pushed to an engine after
each train() (tensor and disk modes) are the trainer's, bit for bit. Two spawned ranks run every 2-rank phase in one
go (megatron's import costs seconds per process); the TP=1 side runs here."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_helpers import (
    FIXED_IDS,
    free_port,
    full_logits,
    full_weights,
    groups,
    megatron_args,
    spawn,
    step_grads,
)
from test_fsdp_helpers import make_groups, make_model_dir

pytestmark = pytest.mark.timeout(900)
torch.set_num_threads(1)

LR = ("--lr", "1e-2")


def _two_rank_phases(rank: int, world: int, out: str, model_dir: str, ports: list[int], readers: dict) -> None:
    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.backends.training_utils.data import flatten_groups

    def save(name, obj):
        if rank == 0:
            torch.save(obj, os.path.join(out, name))

    def trainer(port, *argv, **over):
        t = MegatronTrainer(megatron_args(model_dir, "--actor-num-gpus-per-node", "2", *LR, *argv, **over), rank, world)
        t.init("127.0.0.1", port)
        return t

    # 1. TP=2, distributed optimizer: logits, gradients, one step, save, one more step
    t = trainer(ports[0], "--tensor-model-parallel-size", "2", "--use-distributed-optimizer")
    save("tp2_logits.pt", full_logits(t, FIXED_IDS))
    loss, grads = step_grads(t, groups())
    save("tp2_grads.pt", (loss, grads))
    # the same weights with right-padded micro-batches: log-probs and gradients equal the packed ones
    items = [it for g in flatten_groups(groups())[0] for it in g]
    packed_lps = t._log_probs(t.actor, items)
    t.args = t.args.replace(micro_batch_layout="padded")
    save("tp2_layouts.pt", (packed_lps, t._log_probs(t.actor, items), step_grads(t, groups())))
    t.args = t.args.replace(micro_batch_layout="packed")
    t.train(0, groups(), 0)
    t.save(os.path.join(out, "ckpt_tp2"))
    save("tp2_saved.pt", full_weights(t))
    m = t.train(1, make_groups(seed=22), 1)
    save("tp2_next.pt", (m, full_weights(t)))
    t.shutdown()

    # 2. TP=1 x DP=2, distributed optimizer: resume the TP=2 checkpoint, step, save, step
    t = trainer(ports[1], "--use-distributed-optimizer")
    t.load(os.path.join(out, "ckpt_tp2"))
    save("dp2_loaded.pt", full_weights(t))
    m = t.train(1, make_groups(seed=22), 1)
    save("dp2_next.pt", (m, full_weights(t)))
    t.save(os.path.join(out, "ckpt_dp2"))
    m = t.train(2, make_groups(seed=23), 2)
    save("dp2_after.pt", (m, full_weights(t)))
    t.shutdown()

    # 3. TP=2, plain (non-distributed) optimizer: one step, save, one more step
    t = trainer(ports[2], "--tensor-model-parallel-size", "2")
    t.train(0, groups(), 0)
    t.save(os.path.join(out, "ckpt_tp2_plain"))
    m = t.train(1, make_groups(seed=22), 1)
    save("tp2_plain_next.pt", (m, full_weights(t)))
    t.shutdown()

    # 4. TP=2 with sequence parallelism and dynamic micro-batches: the gradients of phase 1
    t = trainer(ports[3], "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
                "--use-dynamic-batch-size", "--max-tokens-per-gpu", "24")
    save("tp2_sp_grads.pt", step_grads(t, groups()))
    t.shutdown()

    # 5. TP=1 x DP=2, distributed optimizer (each rank steps half the weights; an all-gather brings the other half)
    # with the overlapped gather (deferred to the next forward): 2 rollouts of 2 optimizer steps x 2 micro-batches,
    # each pushed to an SGLang-format reader (tensor, then disk); every rank's weights after each push; and the same
    # training without the overlap
    from sglang_format_reader import wait_ready

    from slime.backends.megatron_utils.update_weight import gather_hf_weights

    def weights(t):
        return dict(gather_hf_weights(t.actor, t.layout, everywhere=True))

    steps = ("--use-distributed-optimizer", "--global-batch-size", "4", "--micro-batch-size", "1")
    overlap = ("--overlap-grad-reduce", "--overlap-param-gather")
    for port, mode, argv in zip(ports[4:], ("tensor", "disk", None), (overlap, overlap, ())):
        t = trainer(port, *steps, *argv, update_weight_mode=mode or "distributed")
        for version in (1, 2):
            t.train(version, make_groups(seed=30 + version), version)
            if mode is not None:
                wait_ready(readers[mode])
                t.update_weights([readers[mode]], version)
            torch.save(weights(t), os.path.join(out, f"dp2_{mode or 'no_overlap'}_v{version}_rank{rank}.pt"))
        if mode == "tensor":  # an optimizer step outside train(): its gather still waits for the next forward
            items, rt, _ = t._prepare(make_groups(seed=33))
            t._train_step(items, rt)
            torch.save(weights(t), os.path.join(out, f"dp2_bare_step_rank{rank}.pt"))
        t.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


class TwoRanks:
    """What the 2-rank phases wrote: `(name)` loads a result, `.path(name)` a checkpoint."""

    def __init__(self, out: str):
        self.out = out

    def __call__(self, name: str):
        return torch.load(os.path.join(self.out, name), weights_only=False)

    def path(self, name: str) -> str:
        return os.path.join(self.out, name)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory):
    from sglang_format_reader import ReaderServer

    out = str(tmp_path_factory.mktemp("megatron_2ranks"))
    # the fake engines start while the ranks do (the ranks wait for them before their first push)
    readers = {mode: ReaderServer(tmp_path_factory.mktemp(f"pushed_{mode}"), wait=False)
               for mode in ("tensor", "disk")}
    try:
        spawn(_two_rank_phases, 2, out, model_dir, [free_port() for _ in range(7)],
              {mode: r.url for mode, r in readers.items()})
    finally:
        for r in readers.values():
            r.stop()
    two = TwoRanks(out)
    two.readers = readers
    return two


@pytest.fixture
def tp1(make_trainer, model_dir):
    """`tp1(*argv)`: a TP=1 Megatron trainer in this process on `model_dir` (conftest's make_trainer)."""
    return lambda *argv: make_trainer("megatron", *LR, *argv, model_dir=model_dir)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_logits_match_transformers_at_tp1_and_tp2(two_ranks, tp1, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        want = hf(input_ids=FIXED_IDS).logits
    assert float(want.abs().max()) > 0.1
    tp1_logits = full_logits(tp1(), FIXED_IDS)
    assert float((tp1_logits - want).abs().max()) <= 1e-5
    assert float((two_ranks("tp2_logits.pt") - want).abs().max()) <= 1e-5


def test_tp2_loss_and_gradients_equal_tp1(two_ranks, tp1):
    loss1, grads1 = step_grads(tp1("--use-distributed-optimizer"), groups())
    loss2, grads2 = two_ranks("tp2_grads.pt")
    assert abs(loss1 - loss2) <= 1e-6
    assert max(float(g.abs().max()) for g in grads1.values()) > 1e-3  # a real gradient
    assert _max_diff(grads1, grads2) <= 1e-6
    qk = [k for k in grads1 if "k_layernorm" in k]
    assert qk and all(float(grads1[k].abs().max()) > 0 for k in qk)  # the TP-replicated norms are reduced too
    loss_sp, grads_sp = two_ranks("tp2_sp_grads.pt")  # + sequence parallel, token-budget micro-batches
    assert abs(loss1 - loss_sp) <= 1e-6
    assert _max_diff(grads1, grads_sp) <= 1e-6


def test_packed_and_padded_micro_batches_agree_at_tp2(two_ranks):
    """fp32, TP=2: packed micro-batches (no padding, attention inside each sample) give the padded path's
    log-probs and gradients."""
    packed_lps, padded_lps, (padded_loss, padded_grads) = two_ranks("tp2_layouts.pt")
    loss, grads = two_ranks("tp2_grads.pt")  # packed (the default)
    assert max(float((a - b).abs().max()) for a, b in zip(packed_lps, padded_lps)) <= 1e-5
    assert abs(loss - padded_loss) <= 1e-6 and _max_diff(grads, padded_grads) <= 1e-5


def test_resume_at_another_tp_dp_is_exact(two_ranks):
    # TP=2 -> TP=1 x DP=2: the weights come back bit for bit, and the next step (Adam state resumed) agrees
    assert _max_diff(two_ranks("tp2_saved.pt"), two_ranks("dp2_loaded.pt")) == 0.0
    m_tp2, w_tp2 = two_ranks("tp2_next.pt")
    m_dp2, w_dp2 = two_ranks("dp2_next.pt")
    assert _max_diff(w_tp2, w_dp2) <= 1e-6
    assert m_tp2["loss"] == pytest.approx(m_dp2["loss"], abs=1e-6)
    assert m_tp2["grad_norm"] == pytest.approx(m_dp2["grad_norm"], rel=1e-5)
    moved = _max_diff(two_ranks("tp2_saved.pt"), w_tp2)
    assert moved > 1e-3  # the step moved the weights well beyond the tolerance


def test_resume_dp2_checkpoint_at_dp1(two_ranks, tp1):
    t = tp1("--use-distributed-optimizer")
    t.load(two_ranks.path("ckpt_dp2"))
    _, after_save = two_ranks("dp2_next.pt")
    assert _max_diff(full_weights(t), after_save) == 0.0
    m_ref, w_ref = two_ranks("dp2_after.pt")
    m = t.train(2, make_groups(seed=23), 2)
    assert _max_diff(full_weights(t), w_ref) <= 1e-6
    assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)


def test_resume_plain_optimizer_tp2_checkpoint_at_tp1(two_ranks, tp1):
    from slime.backends.megatron_utils import checkpoint as ckpt

    t = tp1()
    t.load(two_ranks.path("ckpt_tp2_plain"))
    m_ref, w_ref = two_ranks("tp2_plain_next.pt")
    m = t.train(1, make_groups(seed=22), 1)
    assert _max_diff(full_weights(t), w_ref) <= 1e-6
    assert m["loss"] == pytest.approx(m_ref["loss"], abs=1e-6)
    # the same weights with a fresh Adam land far from that: the optimizer state was resumed
    t.shutdown()
    fresh = tp1()
    ckpt.load_model(fresh.actor, two_ranks.path("ckpt_tp2_plain"))
    fresh.train(1, make_groups(seed=22), 1)
    assert _max_diff(full_weights(fresh), w_ref) > 1e-4


def _pushed(reader, mode: str) -> dict[int, dict[str, torch.Tensor]]:
    """What the reader got, per weight version: tensor buckets (one entry per engine TP rank) or the disk directory."""
    import json

    reqs = [json.loads(line) for line in (reader.out / "requests.jsonl").read_text().splitlines()]
    files = sorted(reader.out.glob("bucket_*.pt" if mode == "tensor" else "disk_*.pt"))
    assert len(files) == len(reqs)
    got: dict[int, dict[str, torch.Tensor]] = {}
    for req, f in zip(reqs, files):
        tensors = torch.load(f)
        for part in (tensors if mode == "tensor" else [tensors]):
            got.setdefault(int(req["weight_version"]), {}).update(part)
    return got


@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_the_push_after_each_step_sends_the_gathered_weights(two_ranks, mode):
    """The stale-weights trap: with the distributed optimizer each DP rank steps only its shard of the weights, and
    with --overlap-param-gather the all-gather that brings the other rank's shard waits for the next forward. A
    push that read the weights before that gather sends rank 1's shard as it was before the step: here what the
    engine got after each train() equals both ranks' weights, bit for bit (each rank's own shard is exact), and the
    same training without the overlap."""
    got = _pushed(two_ranks.readers[mode], mode)
    assert sorted(got) == [1, 2]
    for version in (1, 2):
        ranks = [two_ranks(f"dp2_{mode}_v{version}_rank{r}.pt") for r in (0, 1)]
        plain = two_ranks(f"dp2_no_overlap_v{version}_rank0.pt")
        assert got[version].keys() == ranks[0].keys() == ranks[1].keys() == plain.keys()
        for name, pushed in got[version].items():
            assert all(torch.equal(pushed, w[name]) for w in (*ranks, plain)), (version, name)
    assert _max_diff(got[1], got[2]) > 1e-3  # the second rollout's steps moved the weights


def test_the_overlapped_gather_is_on(two_ranks):
    """What the push test guards against is there: right after an optimizer step (outside train()) each rank holds
    the other rank's half of the weights from before the step, until the next forward gathers it."""
    assert _max_diff(two_ranks("dp2_bare_step_rank0.pt"), two_ranks("dp2_bare_step_rank1.pt")) > 1e-3
