"""Build megatron-core's GPTModel from a HF config, fill it from HF weights, and the teacher-forced forward of a
micro-batch that returns per-token log-probs and entropies from the vocab-parallel chunked head (the full
[tokens, vocabulary] logits never exist)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slime.backends.megatron_utils import hf_weights
from slime.backends.megatron_utils.config import padded_vocab_size, transformer_config
from slime.backends.megatron_utils.layer_spec import block_spec, canonical_name, layer_impl
from slime.backends.training_utils.data import MicroBatch
from slime.backends.training_utils.distributed import device, use_cuda
from slime.backends.training_utils.logprob_head import head_log_probs
from slime.utils.model_shape import ModelShape

logger = logging.getLogger(__name__)


@dataclass
class Built:
    """A GPTModel (`core`) and what runs forward (`model`: DDP / Float16Module around it, or the bare model)."""

    model: nn.Module
    core: nn.Module
    config: object  # TransformerConfig
    shape: ModelShape
    padded_vocab: int
    impl: str = "local"  # the layer spec: "local" or "transformer_engine"


def build_gpt(args, shape: ModelShape, tp: int, trainable: bool, wrap_ddp: bool) -> Built:
    """Weights are randomly initialised until `load_hf` / a checkpoint fills them."""
    from megatron.core.models.gpt import GPTModel

    impl = layer_impl(args)
    cfg = transformer_config(args, shape, tp, use_cuda(), impl)
    vocab = padded_vocab_size(shape.vocab_size, args.make_vocab_size_divisible_by, tp)
    core = GPTModel(
        config=cfg,
        transformer_layer_spec=block_spec(args, shape, impl),
        vocab_size=vocab,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=shape.rotary_base,
    )
    if shape.pad_token_id is not None:
        core.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(shape.pad_token_id))
    core.to(device())
    model: nn.Module = core
    if args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, core)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    elif wrap_ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
        model.train()
    return Built(model=model, core=core, config=cfg, shape=shape, padded_vocab=vocab, impl=impl)


def _padding_idx_hook(pad: int):
    """As transformers' nn.Embedding(padding_idx=pad_token_id): the pad rows pass no gradient back to the table
    (Megatron's VocabParallelEmbedding has no such index). The forward is unchanged."""

    def hook(module, inputs, output):
        ids = inputs[0]
        pad_here = ids == pad  # [b, s] (no host check for "any": that would sync with the device every forward)
        if module.reduce_scatter_embeddings:  # output [s / tp, b, h]: this rank's slice of the sequence
            pad_here = pad_here.t().chunk(module.tp_group.size())[module.tp_group.rank()]
        return torch.where(pad_here[..., None], output.detach(), output)

    return hook


def named_local_params(core: nn.Module) -> dict[str, nn.Parameter]:
    """This rank's parameters under the local spec's names (what `hf_weights` maps), whatever the layer spec."""
    return {canonical_name(n): p for n, p in core.named_parameters()}


@torch.no_grad()
def load_hf(built: Built, hf_dir: str, tp_rank: int, tp: int) -> None:
    reader = hf_weights.HFReader(hf_dir)
    params = named_local_params(built.core)
    expected = set(hf_weights.megatron_names(built.shape))
    if set(params) != expected:
        raise RuntimeError(f"GPTModel parameters differ from the HF mapping: extra {sorted(set(params) - expected)}, "
                           f"missing {sorted(expected - set(params))}")
    for name in hf_weights.megatron_names(built.shape):
        full = hf_weights.hf_to_full(name, reader.get, built.shape, built.padded_vocab)
        local = hf_weights.shard(name, full, tp_rank, tp)
        p = params[name]
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(local.shape)} from the source, the model has {tuple(p.shape)}")
        p.data.copy_(local.to(dtype=p.dtype))


# ---------------------------------------------------------------- forward ----
def final_hidden(built: Built, mb: MicroBatch) -> torch.Tensor:
    """The decoder's output (after the final norm) for `mb`, [S, B, H] on every TP rank, its gradient summed over
    TP on the way back (GPTModel returns hidden states while `post_process` is off)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    psp = None
    if mb.packed:
        # the local spec's RoPE and per-sample attention read the lengths from `cu_seqlens_*_padded` (our segments
        # carry no padding): the host's copy, so no layer waits for the device; TE takes the device's tensors
        host = mb.cu_seqlens_host if built.impl == "local" else None
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                              cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host,
                              max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
    core = built.core
    core.post_process = False
    try:
        hidden = built.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=None,
                             packed_seq_params=psp)
    finally:
        core.post_process = True
    if built.config.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    return copy_to_tensor_model_parallel_region(hidden)


def output_weight(built: Built) -> torch.Tensor:
    """This TP rank's rows of the output projection (the word embeddings when tied)."""
    core = built.core
    return core.shared_embedding_or_output_weight() if core.share_embeddings_and_output_weights \
        else core.output_layer.weight


def forward_micro_batch(built: Built, mb: MicroBatch, temperature: float, chunk_size: int,
                        with_entropy: bool = False, entropy_grad: bool = False, fused: bool = False
                        ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Teacher-forced forward: the response tokens' log-probs [R], their entropies (or None) and a tensor that
    depends on every parameter used (for a no-op backward)."""
    hidden = final_hidden(built, mb)  # [S, B, H]
    s, b = hidden.size(0), hidden.size(1)
    # rows index the [B, S] layout of input_ids; hidden is [S, B]: row r = (r // S, r % S) -> (r % S) * B + r // S
    rows = (mb.rows % s) * b + mb.rows // s if b > 1 else mb.rows
    h = hidden.reshape(s * b, -1).index_select(0, rows)
    weight = output_weight(built)
    from megatron.core import parallel_state as mpu

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    lp, ent = head_log_probs(h, weight, mb.targets, temperature, vocab_size=built.shape.vocab_size,
                             vocab_start=tp_rank * weight.size(0), chunk_size=chunk_size,
                             tp_group=mpu.get_tensor_model_parallel_group() if tp > 1 else None,
                             with_entropy=with_entropy, entropy_grad=entropy_grad, fused=fused)
    return lp, ent, lp
