"""Megatron's TransformerConfig from the HF config and slime's flags."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from slime.backends.training_utils.distributed import compile_ops
from slime.utils.model_shape import ModelShape


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """The vocabulary padded to a multiple of lcm(divisible_by, TP): one shape for every TP that divides
    divisible_by, so a checkpoint resumes at another TP (Megatron-LM's divisible_by x TP changes it)."""
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def transformer_config(args, shape: ModelShape, tp: int, use_cuda: bool, impl: str = "local"):
    """`impl`: "local" or "transformer_engine" (`layer_spec.layer_impl`)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        qk_layernorm=shape.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.add_qkv_bias,
        hidden_dropout=args.hidden_dropout if args.hidden_dropout is not None else 0.0,
        attention_dropout=args.attention_dropout if args.attention_dropout is not None else shape.attention_dropout,
        init_method_std=shape.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=args.sequence_parallel,
        params_dtype=dtype,
        bf16=args.bf16,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32 or not args.bf16,
        # local: the layer spec picks the core attention (model.py); TE picks its own kernels
        attention_backend=AttnBackend.auto if impl == "transformer_engine" else AttnBackend.local,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        use_cpu_initialization=not use_cuda,
        # (weights are loaded afterwards, but initialisation marks TP-split parameters for the grad norm)
        perform_initialization=True,
        # no apex; --compile-ops (or TE) fuses SwiGLU through megatron's torch.compile'd bias_swiglu
        gradient_accumulation_fusion=False,
        bias_activation_fusion=compile_ops(args) or impl == "transformer_engine",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=impl == "transformer_engine" and not args.no_rope_fusion,
    )
