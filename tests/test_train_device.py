"""The trainer's hot path never waits for the device, checked without a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_helpers import megatron_args
from test_fsdp_helpers import make_args, make_groups, make_model_dir

from slime.backends.training_utils.data import build_micro_batch, flatten_groups
from slime.backends.training_utils.loss import RolloutTensors, loss_inputs, micro_batch_loss

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(300)
TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::lift_fresh"}  # how data is meant to reach the device


class HostDeviceMix(TorchDispatchMode):
    """Records ops that take a host tensor of one element or more beside a `meta` (device) tensor."""

    def __init__(self):
        super().__init__()
        self.mixed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if t.dim() > 0}
        if "meta" in devices and "cpu" in devices and func._schema.name not in TRANSFERS:
            self.mixed.append(f"{func._schema.name}: {[(t.device.type, tuple(t.shape)) for t in tensors]}")
        return func(*args, **kwargs)


def whole_row_causal(q, k, v, cu_seqlens, max_seqlen, scale=None, dropout_p=0.0):
    """Shape-true stand-in for the GPU's varlen attention ([T, H, D] in and out, no host read)."""
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=k.size(1) != q.size(1))
    return out.squeeze(0).transpose(0, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture
def varlen_on_device(monkeypatch):
    import slime.backends.megatron_utils.attention as megatron_attention
    import slime.backends.training_utils.varlen as varlen

    monkeypatch.setattr(megatron_attention, "packed_causal_attention", whole_row_causal)
    monkeypatch.setattr(varlen, "packed_causal_attention", whole_row_causal)


@pytest.fixture(scope="module")
def megatron_on_meta(model_dir):
    """Megatron's GPTModel (our local layer spec) on `meta`, built inside a real trainer's process groups."""
    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.backends.megatron_utils.model import build_gpt
    from slime.utils.model_shape import read_shape

    t = MegatronTrainer(megatron_args(model_dir))
    t.init()
    try:
        built = build_gpt(t.args, read_shape(model_dir), 1, trainable=True, wrap_ddp=False)
        core = built.core.to("meta")
        rope = core.rotary_pos_emb
        rope.inv_freq = rope.inv_freq.to("meta")  # a plain attribute: on the GPU it is made there
        yield dataclasses.replace(built, model=core, core=core)
    finally:
        t.shutdown()


@pytest.fixture(scope="module")
def hf_on_meta(model_dir):
    from slime.backends.fsdp_utils.model import load_hf_model

    return load_hf_model(model_dir).to("meta")


def one_micro_batch(args, forward, packed: bool):
    """Inputs, forward, head, loss and backward of one micro-batch of 3 samples on `meta`."""
    groups, _ = flatten_groups(make_groups(seed=3))
    items = [it for g in groups for it in g][:3]
    rt = RolloutTensors(old_log_probs=[torch.full((it.response_len,), -1.0) for it in items], ref_log_probs=None,
                        advantages=[torch.ones(it.response_len) for it in items],
                        tis_weights=[torch.ones(it.response_len) for it in items], metrics={})
    for i, it in enumerate(items):
        it.pos = i
    audit = HostDeviceMix()
    with audit:
        mb = build_micro_batch(items, 0, packed, "meta")
        inp = loss_inputs(args, rt, [0, 1, 2], [it.loss_mask for it in items], 9.0, 3.0, "meta")
        lp, ent, _ = forward(mb)
        loss, metrics = micro_batch_loss(args, lp, ent, inp)
        loss.backward()
    assert lp.device.type == "meta" and lp.shape == (sum(it.response_len for it in items),)
    assert all(v.device.type == "meta" and v.dim() == 0 for v in metrics.values())
    assert not audit.mixed, audit.mixed


@pytest.fixture
def fused_uncompiled(monkeypatch):
    """The fused head's kernels as plain functions."""
    import types

    import slime.backends.training_utils.logprob_head as head

    kernels = types.SimpleNamespace(max_and_target=head._max_and_target, exp_sums=head._exp_sums,
                                    logit_grad=head._logit_grad)
    monkeypatch.setattr(head, "fused_kernels", lambda: kernels)


@pytest.mark.parametrize("fused", [False, True], ids=["eager_head", "fused_head"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_megatron_micro_batch_never_reads_the_device(model_dir, megatron_on_meta, varlen_on_device, fused_uncompiled,
                                                     monkeypatch, packed, fused):
    """Megatron's forward included: our RoPE and packed lengths from the host, no device reads."""
    import megatron.core.transformer.attention as megatron_attention

    from slime.backends.megatron_utils.model import forward_micro_batch

    def megatrons_rope(*a, **k):
        raise AssertionError("megatron's own RoPE ran")

    monkeypatch.setattr(megatron_attention, "apply_rotary_pos_emb", megatrons_rope)

    args = megatron_args(model_dir, use_tis=True, entropy_coef=0.01)
    one_micro_batch(args, lambda mb: forward_micro_batch(megatron_on_meta, mb, 0.8, 5, True, True, fused), packed)


@pytest.mark.parametrize("fused", [False, True], ids=["eager_head", "fused_head"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_fsdp_micro_batch_never_reads_the_device(model_dir, hf_on_meta, varlen_on_device, fused_uncompiled, packed,
                                                 fused):
    from slime.backends.fsdp_utils.model import forward_micro_batch

    args = make_args(model_dir, "--train-backend", "fsdp", "--advantage-estimator", "gspo", "--eps-clip-c", "3")
    one_micro_batch(args, lambda mb: forward_micro_batch(hf_on_meta, mb, 1.0, 4, True, False, fused), packed)
