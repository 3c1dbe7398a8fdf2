"""Process-group setup, model loading and FSDP2 sharding (fp32 master weights; bf16 compute with --bf16), packed-
aware attention (`slime_sdpa`), and the teacher-forced forward of a micro-batch through the chunked log-prob head."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slime.backends.training_utils.data import MicroBatch
from slime.backends.training_utils.distributed import compile_ops, device, free_port, init_distributed, use_cuda  # noqa: F401
from slime.backends.training_utils.logprob_head import head_log_probs

logger = logging.getLogger(__name__)

PACKED_SDPA = "slime_sdpa"


def _packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: query [B, Hq, S, D], key / value [B, Hkv, S, D] -> ([B, S, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from slime.backends.training_utils.varlen import packed_causal_attention

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # padded (right padding, causal): no mask needed
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, is_causal=True)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [S, H, D]
    out = packed_causal_attention(q, k, v, cu, int(kwargs["max_length_q"]), scale=scaling, dropout_p=dropout)
    return out.unsqueeze(0), None


def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, _packed_sdpa_attention)
    return PACKED_SDPA


class HeadOrHidden(nn.Linear):
    """The model's output projection; while `emit_hidden` is set it returns its input (the final hidden states)."""

    emit_hidden = False

    def forward(self, x: Tensor) -> Tensor:
        # a copy, not the caller's slice: FSDP2 hooks the root's output for the backward, and a view's
        # hook is lost if anyone writes into it
        return x.clone() if self.emit_hidden else super().forward(x)


def load_hf_model(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--hf-checkpoint / --ref-load: {path!r} is not a directory with a HF model")
    impl = _register_attention() if attn_implementation == "sdpa" else attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl)
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"{type(model).__name__}: the output projection is a {type(head).__name__}"
                         f"{' with a bias' if type(head) is nn.Linear else ''}; the trainer's log-prob head needs a "
                         "bias-free nn.Linear")
    head.__class__ = HeadOrHidden
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod = model
        try:
            for part in attr.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def shard_model(model: nn.Module, bf16: bool = False) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root; with `bf16`, parameters are gathered as bf16 for compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    # one rank holds every parameter whole anyway: resharding after the forward would only free and re-gather
    kw = {"mesh": mesh, "reshard_after_forward": dist.get_world_size() > 1}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model.to(device())
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    # the root stays gathered after the forward: the chunked head reads the output projection's weight after it
    fully_shard(model, **{**kw, "reshard_after_forward": False})
    return model


def compile_elementwise(model: nn.Module) -> int:
    """--compile-ops: torch.compile every RMSNorm and MLP (dynamic shapes); returns how many modules."""
    n = 0
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm") or name.endswith("MLP"):
            m.compile(dynamic=True)
            n += 1
    return n


def build_model(path: str, trainable: bool, args) -> nn.Module:
    model = load_hf_model(path, args.attn_implementation)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    if compile_ops(args) and not compile_elementwise(model):
        raise ValueError(f"--compile-ops: {type(model).__name__} has no RMSNorm / MLP modules to compile")
    return shard_model(model, bf16=bool(args.bf16))


def describe(args) -> str:
    """One line for the start-up log: the kernels this trainer runs."""
    attn = {"sdpa": "torch SDPA (packed: varlen kernel on a GPU in bf16, else one call per sample)",
            "flash_attention_2": "flash-attn (packed: its varlen kernel)",
            "eager": "eager (packed: a block-diagonal mask)"}[args.attn_implementation]
    ops = ("RMSNorm, MLP and the log-prob head through torch.compile" if compile_ops(args)
           else "unfused element-wise ops") + f" (--compile-ops {args.compile_ops})"
    return f"attention {attn}; {ops}"


def final_hidden(model: nn.Module, mb: MicroBatch) -> Tensor:
    """[B, S, H] (padded) or [1, T, H] (packed): the final norm's output, the output projection skipped."""
    head = model.get_output_embeddings()
    kw = {}
    if mb.packed:
        kw = dict(cu_seq_lens_q=mb.cu_seqlens, cu_seq_lens_k=mb.cu_seqlens, max_length_q=mb.max_seqlen,
                  max_length_k=mb.max_seqlen)
    head.emit_hidden = True
    try:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    use_cache=False, **kw)
    finally:
        head.emit_hidden = False
    return out.logits


def forward_micro_batch(model: nn.Module, mb: MicroBatch, temperature: float, chunk_size: int,
                        with_entropy: bool = False, entropy_grad: bool = False, fused: bool = False
                        ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Teacher-forced forward: the response tokens' log-probs [R], their entropies (or None) and a tensor that
    depends on every parameter used (for a no-op backward)."""
    hidden = final_hidden(model, mb)
    h = hidden.reshape(-1, hidden.size(-1)).index_select(0, mb.rows)
    # the root's parameters stay unsharded until the backward: the full weight, in the compute dtype
    weight = model.get_output_embeddings().weight
    lp, ent = head_log_probs(h, weight, mb.targets, temperature, chunk_size=chunk_size, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, fused=fused)
    return lp, ent, lp
