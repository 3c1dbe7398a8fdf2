"""Build megatron-core's GPTModel from a HF config (local layer spec, no
TransformerEngine), fill it from HF weights or full tensors, and the
teacher-forced forward that returns per-token log-probs (vocab-parallel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slime.backends.megatron_utils import hf_weights
from slime.backends.megatron_utils.config import padded_vocab_size, transformer_config
from slime.backends.training_utils.data import TrainItem, collate
from slime.backends.training_utils.distributed import device, use_cuda
from slime.utils.model_shape import ModelShape
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs

logger = logging.getLogger(__name__)


@dataclass
class Built:
    """A GPTModel and what wraps it: `model` is what runs forward (DDP /
    Float16Module around it, or the bare model), `core` the GPTModel."""

    model: nn.Module
    core: nn.Module
    config: object  # TransformerConfig
    shape: ModelShape
    padded_vocab: int


def block_spec(args, shape: ModelShape):
    """megatron's local (TransformerEngine-free) layer spec with our RMSNorm
    everywhere and, for `--attention-backend flash/auto`, SDPA attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from slime.backends.megatron_utils.norm import RMSNorm

    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if shape.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = RMSNorm
    if args.attention_backend in ("auto", "flash"):
        from slime.backends.megatron_utils.attention import SDPAttention

        attn.core_attention = SDPAttention
    return TransformerBlockSubmodules(layer_specs=[spec] * shape.num_layers, layer_norm=RMSNorm)


def build_gpt(args, shape: ModelShape, tp: int, trainable: bool, wrap_ddp: bool) -> Built:
    """Weights are randomly initialised until `load_hf` / a checkpoint fills them."""
    from megatron.core.models.gpt import GPTModel

    cfg = transformer_config(args, shape, tp, use_cuda())
    vocab = padded_vocab_size(shape.vocab_size, args.make_vocab_size_divisible_by, tp)
    core = GPTModel(
        config=cfg,
        transformer_layer_spec=block_spec(args, shape),
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
            overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        model = DistributedDataParallel(config=cfg, ddp_config=ddp_cfg, module=model)
        model.train()
    return Built(model=model, core=core, config=cfg, shape=shape, padded_vocab=vocab)


def named_local_params(core: nn.Module) -> dict[str, nn.Parameter]:
    return dict(core.named_parameters())


@torch.no_grad()
def load_full(built: Built, get_full, tp_rank: int, tp: int) -> None:
    """Fill every parameter from `get_full(megatron_name) -> full tensor`."""
    params = named_local_params(built.core)
    expected = set(hf_weights.megatron_names(built.shape))
    if set(params) != expected:
        raise RuntimeError(f"GPTModel parameters differ from the HF mapping: extra {sorted(set(params) - expected)}, "
                           f"missing {sorted(expected - set(params))}")
    for name in hf_weights.megatron_names(built.shape):
        local = hf_weights.shard(name, get_full(name), tp_rank, tp)
        p = params[name]
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(local.shape)} from the source, the model has {tuple(p.shape)}")
        p.data.copy_(local.to(dtype=p.dtype))


def load_hf(built: Built, hf_dir: str, tp_rank: int, tp: int) -> None:
    reader = hf_weights.HFReader(hf_dir)
    load_full(built, lambda n: hf_weights.hf_to_full(n, reader.get, built.shape, built.padded_vocab), tp_rank, tp)


# ---------------------------------------------------------------- forward ----
def _tp_info():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()


def vocab_parallel_log_probs(logits: Tensor, targets: Tensor, temperature: float, vocab_size: int,
                             with_entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / T)[target] and (optionally) the entropy, over a
    vocabulary split across TP ranks (`logits`: [N, V_local]); padded
    vocabulary columns never get probability. At TP=1 this is the same
    function the FSDP trainer uses."""
    tp, tp_rank = _tp_info()
    if tp == 1:
        lg = logits[:, :vocab_size]
        ent = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ent = compute_entropy_from_logits(lg if entropy_grad else lg.detach(), temperature)
        return compute_log_probs(lg, targets, temperature), ent

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    t = temperature if temperature > 0 else 1.0
    v_local = logits.size(-1)
    start = tp_rank * v_local
    x = logits.float() / t
    pad = (torch.arange(v_local, device=x.device) + start) >= vocab_size
    if bool(pad.any()):
        x = x.masked_fill(pad, float("-inf"))
    m = x.detach().max(dim=-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mpu.get_tensor_model_parallel_group())
    shifted = x - m.unsqueeze(-1)
    exp = shifted.exp()
    lse = tp_sum(exp.sum(-1)).log()
    local_t = targets - start
    mine = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(mine, picked, torch.zeros_like(picked))  # not `* mine`: padded columns hold -inf
    log_probs = tp_sum(picked) - lse
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            s = shifted if entropy_grad else shifted.detach()
            p = (s - (lse if entropy_grad else lse.detach()).unsqueeze(-1)).exp()
            ent = (lse if entropy_grad else lse.detach()) - tp_sum((p * s.masked_fill(pad, 0.0)).sum(-1))
    return log_probs, ent


def forward_items(model: nn.Module, items: list[TrainItem], pad_id: int, temperature: float, vocab_size: int,
                  seq_multiple: int = 1, with_entropy: bool = False, entropy_grad: bool = False
                  ) -> tuple[list[Tensor], list[Tensor] | None, Tensor]:
    """Teacher-forced forward on one micro-batch (right-padded, causal).
    Returns per-item response log-probs, entropies (or None) and the logits
    (to keep the graph alive)."""
    batch = collate(items, pad_id, device())
    ids = batch.input_ids
    if ids.size(1) % seq_multiple:  # sequence parallel: length divisible by TP
        extra = seq_multiple - ids.size(1) % seq_multiple
        ids = torch.cat([ids, ids.new_full((ids.size(0), extra), pad_id)], dim=1)
    positions = torch.arange(ids.size(1), device=ids.device).unsqueeze(0).expand_as(ids)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None)  # [B, S, V_local]
    rows = torch.cat([logits[i, it.prompt_len - 1 : it.num_tokens - 1] for i, it in enumerate(items)])
    targets = torch.cat([it.tokens[it.prompt_len :] for it in items]).to(rows.device)
    lp, ent = vocab_parallel_log_probs(rows, targets, temperature, vocab_size, with_entropy, entropy_grad)
    sizes = [it.response_len for it in items]
    return list(lp.split(sizes)), (list(ent.split(sizes)) if ent is not None else None), logits
