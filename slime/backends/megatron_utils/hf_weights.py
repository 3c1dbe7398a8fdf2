"""HF ⇄ Megatron weights (Qwen3, Qwen2, Llama), in memory, under the bare GPTModel's names. A Megatron weight is
*full* (the TP=1 layout: QKV fused per query group, `linear_fc1` = cat(gate, up), vocabulary rows padded), *local*
(one TP rank's shard: `shard` / `unshard`) or *HF* (transformers' names and tensors)."""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch
from torch import Tensor

from slime.utils.model_shape import ModelShape

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# per-layer Megatron suffix → HF suffix under model.layers.{i}.  (1:1 weights)
_LAYER_1TO1 = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_ROW_PARALLEL = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")  # split along dim 1
_COLUMN_PARALLEL = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")  # dim 0, contiguous
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")  # dim 0, padded rows
_OUTSIDE_LAYERS = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
                   "output_layer.weight": "lm_head.weight", "decoder.final_layernorm.weight": "model.norm.weight"}


def megatron_names(shape: ModelShape) -> list[str]:
    """Every parameter of the GPTModel, in the order weights travel."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if shape.add_qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if shape.qk_layernorm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not shape.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


# ------------------------------------------------------------ full ⇄ HF ----
def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape) -> Tensor:
    g, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(
        g * (per + 2) * d, *rest)


def _split_qkv(qkv: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    g, d = shape.num_query_groups, shape.kv_channels
    per = shape.num_attention_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return q.reshape(g * per * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _layer(name: str, what: str) -> tuple[str, str]:
    """(HF prefix `model.layers.{i}.`, Megatron suffix) of a decoder-layer parameter."""
    m = _LAYER.match(name)
    if m is None:
        raise KeyError(f"no HF {what} for Megatron parameter {name!r}")
    return f"model.layers.{m.group(1)}.", m.group(2)


def hf_to_full(name: str, get: Callable[[str], Tensor], shape: ModelShape, padded_vocab: int) -> Tensor:
    """The full Megatron tensor `name`, from HF tensors fetched by `get(hf_name)`."""
    if name in _OUTSIDE_LAYERS:
        t = get(_OUTSIDE_LAYERS[name])
        return _pad_rows(t, padded_vocab) if name in _VOCAB else t
    hf, sub = _layer(name, "source")
    if sub in _LAYER_1TO1:
        return get(hf + _LAYER_1TO1[sub])
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        return _fuse_qkv(*(get(f"{hf}self_attn.{x}_proj.{kind}") for x in "qkv"), shape)
    if sub == "mlp.linear_fc1.weight":
        return torch.cat([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")])
    raise KeyError(f"no HF source for Megatron parameter {name!r}")


def full_to_hf(name: str, full: Tensor, shape: ModelShape) -> list[tuple[str, Tensor]]:
    """HF (name, tensor) pairs of one full Megatron tensor (vocabulary padding removed)."""
    if name in _OUTSIDE_LAYERS:
        return [(_OUTSIDE_LAYERS[name], full[: shape.vocab_size] if name in _VOCAB else full)]
    hf, sub = _layer(name, "name")
    if sub in _LAYER_1TO1:
        return [(hf + _LAYER_1TO1[sub], full)]
    if sub in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = sub.rsplit(".", 1)[1]
        return [(f"{hf}self_attn.{x}_proj.{kind}", t) for x, t in zip("qkv", _split_qkv(full, shape))]
    if sub == "mlp.linear_fc1.weight":
        gate, up = full.chunk(2)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    raise KeyError(f"no HF name for Megatron parameter {name!r}")


# ---------------------------------------------------------- full ⇄ local ----
def _suffix(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(2) if m else name


def shard(name: str, full: Tensor, tp_rank: int, tp: int) -> Tensor:
    """This TP rank's part of a full tensor."""
    sub = _suffix(name)
    if tp == 1:
        return full
    if sub == "mlp.linear_fc1.weight":  # gate and up are split separately: [gate_r; up_r]
        return torch.cat([half.chunk(tp)[tp_rank] for half in full.chunk(2)])
    if sub in _ROW_PARALLEL:
        return full.chunk(tp, dim=1)[tp_rank]
    if sub in _COLUMN_PARALLEL or name in _VOCAB:
        return full.chunk(tp, dim=0)[tp_rank]
    return full  # norms: replicated


def unshard(name: str, parts: list[Tensor]) -> Tensor:
    """The full tensor from every TP rank's part (rank order)."""
    sub = _suffix(name)
    if len(parts) == 1:
        return parts[0]
    if sub == "mlp.linear_fc1.weight":
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    if sub in _ROW_PARALLEL:
        return torch.cat(parts, dim=1)
    if sub in _COLUMN_PARALLEL or name in _VOCAB:
        return torch.cat(parts, dim=0)
    return parts[0]


def is_tp_split(name: str) -> bool:
    sub = _suffix(name)
    return sub in _ROW_PARALLEL or sub in _COLUMN_PARALLEL or sub == "mlp.linear_fc1.weight" or name in _VOCAB


# ------------------------------------------------------------- HF files ----
class HFReader:
    """Lazy access to the tensors of a HF directory (one or several safetensors files)."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            files = ["model.safetensors"]
            weight_map = None
        else:
            raise FileNotFoundError(f"--hf-checkpoint: {hf_dir!r} has no model.safetensors(.index.json)")
        self._handles = {f: safe_open(os.path.join(hf_dir, f), framework="pt") for f in files}
        if weight_map is None:
            weight_map = {k: files[0] for k in self._handles[files[0]].keys()}
        self._where = weight_map
        self.hf_dir = hf_dir

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> Tensor:
        if name not in self._where:
            if name == "lm_head.weight" and "model.embed_tokens.weight" in self._where:
                return self.get("model.embed_tokens.weight")  # tied checkpoints omit the head
            raise KeyError(f"{self.hf_dir}: no tensor {name!r}")
        return self._handles[self._where[name]].get_tensor(name)
