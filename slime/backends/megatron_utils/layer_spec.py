"""Which transformer layer the GPTModel is built from, chosen once at start-up and logged: `transformer_engine`
(TE's fused layers, where it imports on CUDA) or `local` (our RMSNorm, packed-aware attention and RoPE).
`canonical_name` maps TE's parameter names to the local spec's (what `hf_weights` and the weight sync speak);
checkpoints hold the names of the layer they were saved from.
"""

from __future__ import annotations

import importlib.util
import logging
import re

import torch

from slime.backends.training_utils.distributed import compile_ops
from slime.utils.model_shape import ModelShape

logger = logging.getLogger(__name__)

_TE_TO_LOCAL = (
    (re.compile(r"^(decoder\.layers\.\d+\.)self_attention\.linear_qkv\.layer_norm_weight$"), r"\1input_layernorm.weight"),
    (re.compile(r"^(decoder\.layers\.\d+\.)mlp\.linear_fc1\.layer_norm_weight$"), r"\1pre_mlp_layernorm.weight"),
)


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001  (a broken install: say why, build the local layer)
        logger.warning("transformer_engine is installed but does not import (%s): using the local layer spec", e)
        return False
    return True


def layer_impl(args) -> str:
    """"transformer_engine" or "local" for `--transformer-impl` (auto: TE where it imports on CUDA)."""
    if args.transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise RuntimeError("--transformer-impl transformer_engine: Transformer Engine does not import on this "
                               "machine (it needs CUDA and the transformer_engine package); use local or auto")
        return "transformer_engine"
    if args.transformer_impl == "local":
        return "local"
    return "transformer_engine" if transformer_engine_available() else "local"


def canonical_name(name: str) -> str:
    """A GPTModel parameter name under the local spec's naming (TE's fused pre-norms renamed)."""
    for pattern, repl in _TE_TO_LOCAL:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def block_spec(args, shape: ModelShape, impl: str):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_layernorm)
        return TransformerBlockSubmodules(layer_specs=[spec] * shape.num_layers, layer_norm=TENorm)

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime.backends.megatron_utils.attention import PackedLocalAttention, SDPAttention
    from slime.backends.megatron_utils.norm import CompiledRMSNorm, RMSNorm
    from slime.backends.megatron_utils.rope import RoPESelfAttention

    norm = CompiledRMSNorm if compile_ops(args) else RMSNorm
    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    layer, attn = spec.submodules, spec.submodules.self_attention.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if shape.qk_layernorm:
        attn.q_layernorm = attn.k_layernorm = norm
    attn.core_attention = SDPAttention if args.attention_backend in ("auto", "flash") else PackedLocalAttention
    # RoPE after the q / k norms by our kernel (compiled with --compile-ops), not megatron's unfused one (rope.py)
    spec.submodules.self_attention.module = RoPESelfAttention
    spec.submodules.self_attention.params = {**spec.submodules.self_attention.params,
                                             "fused_rope": compile_ops(args) and not args.no_rope_fusion}
    return TransformerBlockSubmodules(layer_specs=[spec] * shape.num_layers, layer_norm=norm)


def describe(args, impl: str) -> str:
    """One line for the start-up log."""
    if impl == "transformer_engine":
        return "Transformer Engine layer spec (fused norms + linears, fused RoPE, TE attention)"
    attn = "torch SDPA" if args.attention_backend in ("auto", "flash") else "megatron unfused attention"
    fused = (("RMSNorm, RoPE, SwiGLU and the log-prob head through torch.compile" if compile_ops(args)
             else "unfused element-wise ops") + f" (--compile-ops {args.compile_ops})")
    return f"local layer spec ({attn}, packed: varlen kernel / per sample; {fused})"
