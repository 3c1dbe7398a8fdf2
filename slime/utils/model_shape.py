"""The shape of a decoder-only LM from a HF `config.json`, and the check of Megatron's model-shape flags (slime's
MODEL_ARGS) against it: a flag that disagrees with the checkpoint fails, naming the flag, both values and the file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")


@dataclass(frozen=True)
class ModelShape:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_layernorm: bool
    add_qkv_bias: bool
    initializer_range: float
    attention_dropout: float
    # transformers' nn.Embedding(padding_idx=pad_token_id): that row gets no gradient from its lookups
    pad_token_id: int | None = None


class ModelShapeError(ValueError):
    pass


def _rope_theta(cfg: dict) -> float:
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default") if rope else "default"
    scaling = cfg.get("rope_scaling")
    if kind != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise ModelShapeError(f"rope scaling ({kind if kind != 'default' else scaling}) is not supported by the "
                              "Megatron backend yet")
    return float(theta)


def _padding_idx(cfg: dict, where: str) -> int | None:
    pad, vocab = cfg.get("pad_token_id"), int(cfg.get("vocab_size", 0))
    if pad is None:
        return None
    if not -vocab <= int(pad) < vocab:  # nn.Embedding refuses it too
        raise ModelShapeError(f"{where}: pad_token_id {pad} is outside the vocabulary ({vocab})")
    return int(pad) % vocab  # nn.Embedding counts a negative padding_idx from the end


def shape_from_config(cfg: dict, where: str = "config.json") -> ModelShape:
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ModelShapeError(f"{where}: model_type {mtype!r} is not supported by the Megatron backend "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelShapeError(f"{where}: hidden_act {cfg.get('hidden_act')!r}; only SwiGLU (silu) is supported")
    if cfg.get("use_sliding_window"):
        raise ModelShapeError(f"{where}: sliding-window attention is not supported by the Megatron backend")
    if cfg.get("mlp_bias"):
        raise ModelShapeError(f"{where}: MLP biases are not supported by the Megatron backend")
    missing = [k for k in ("num_attention_heads", "hidden_size") if k not in cfg]
    if missing:
        raise ModelShapeError(f"{where}: missing field {missing[0]!r}")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    qkv_bias = bool(cfg.get("attention_bias", mtype == "qwen2"))
    if mtype == "llama" and qkv_bias:
        raise ModelShapeError(f"{where}: Llama attention biases (q/k/v/o) are not supported; only Qwen2's q/k/v bias is")
    try:
        return ModelShape(
            model_type=mtype,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(cfg.get("num_key_value_heads") or heads),
            kv_channels=int(cfg.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(cfg["intermediate_size"]),
            norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
            rotary_base=_rope_theta(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_layernorm=mtype == "qwen3",
            add_qkv_bias=qkv_bias,
            initializer_range=float(cfg.get("initializer_range", 0.02)),
            attention_dropout=float(cfg.get("attention_dropout", 0.0)),
            pad_token_id=_padding_idx(cfg, where),
        )
    except KeyError as e:
        raise ModelShapeError(f"{where}: missing field {e.args[0]!r}") from e


def read_shape(hf_dir: str) -> ModelShape:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelShapeError(f"--hf-checkpoint: {hf_dir!r} has no config.json")
    with open(path) as f:
        return shape_from_config(json.load(f), path)


# flag → (shape field, how the flag's value maps to it)
_VALUE_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "norm_epsilon": "norm_epsilon",
    "rotary_base": "rotary_base",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
}


def _bool_flags(shape: ModelShape) -> dict[str, bool]:
    """What each boolean model flag would have to be for this checkpoint."""
    return {
        "swiglu": True,
        "qk_layernorm": shape.qk_layernorm,
        "add_qkv_bias": shape.add_qkv_bias,
        "untie_embeddings_and_output_weights": not shape.tie_word_embeddings,
        "group_query_attention": shape.num_query_groups != shape.num_attention_heads,
        "disable_bias_linear": True,
        "use_rotary_position_embeddings": True,
    }


def flag_mismatches(args, shape: ModelShape, where: str) -> list[str]:
    """Every model-shape flag the user set that disagrees with the checkpoint."""
    errors = []
    given_flags = vars(args)
    for flag, field in _VALUE_FLAGS.items():
        given = given_flags[flag]
        if given is None:
            continue
        want = getattr(shape, field)
        if (given != want) if not isinstance(want, float) else abs(float(given) - want) > 1e-12 * max(1.0, abs(want)):
            errors.append(f"--{flag.replace('_', '-')} {given} but {where} says {want}")
    for flag, want in _bool_flags(shape).items():  # store_true flags: None when not given
        if given_flags[flag] and not want:
            errors.append(f"--{flag.replace('_', '-')} is set but {where} describes a model without it")
    if args.normalization is not None and args.normalization != "RMSNorm":
        errors.append(f"--normalization {args.normalization}: {where} uses RMSNorm")
    if args.position_embedding_type is not None and args.position_embedding_type != "rope":
        errors.append(f"--position-embedding-type {args.position_embedding_type}: {where} uses rope")
    return errors


def shape_from_flags(args) -> ModelShape:
    """The shape that Megatron's model-shape flags (a slime script's MODEL_ARGS) describe, for a dry run on a machine
    without the model's config.json. Raises ModelShapeError naming the flags it still needs."""
    needed = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
    missing = [n for n in needed if vars(args)[n] is None]
    if missing:
        raise ModelShapeError("the model-shape flags lack " + ", ".join("--" + n.replace("_", "-") for n in missing))
    heads = args.num_attention_heads
    return ModelShape(
        model_type="from flags", vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=heads, num_query_groups=args.num_query_groups or heads,
        kv_channels=args.kv_channels or args.hidden_size // heads, ffn_hidden_size=args.ffn_hidden_size,
        norm_epsilon=args.norm_epsilon or 1e-6, rotary_base=args.rotary_base or 10000.0,
        max_position_embeddings=args.max_position_embeddings or 0,
        tie_word_embeddings=not args.untie_embeddings_and_output_weights, qk_layernorm=bool(args.qk_layernorm),
        add_qkv_bias=bool(args.add_qkv_bias), initializer_range=0.02, attention_dropout=0.0)


def num_params(shape: ModelShape, vocab: int | None = None) -> int:
    """Parameters of the decoder-only LM (`vocab`: the padded vocabulary, default the config's)."""
    h, q, kv = shape.hidden_size, shape.num_attention_heads * shape.kv_channels, shape.num_query_groups * shape.kv_channels
    layer = h * (q + 2 * kv) + q * h + 3 * h * shape.ffn_hidden_size + 2 * h
    layer += (q + 2 * kv) if shape.add_qkv_bias else 0
    layer += 2 * shape.kv_channels if shape.qk_layernorm else 0
    embed = (vocab or shape.vocab_size) * h
    return shape.num_layers * layer + h + embed * (1 if shape.tie_word_embeddings else 2)
