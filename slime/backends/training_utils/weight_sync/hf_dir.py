"""A plain HF model directory from HF-named tensors: the weight sync's disk path, the Megatron trainer's exports and
conversions. The config and tokenizer come from the run's --hf-checkpoint; weights as safetensors, sharded with an
index above `SAFETENSORS_SHARD_BYTES`."""

from __future__ import annotations

import json
import os
import shutil

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")
SAFETENSORS_SHARD_BYTES = 4 * 1024**3


def write_hf_dir(state: dict[str, torch.Tensor], path: str, origin_hf_dir: str | None) -> None:
    """A plain HF model directory: config (and tokenizer) of `origin_hf_dir`,
    weights from `state` (safetensors, sharded above 4 GiB with an index)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    if not origin_hf_dir or not os.path.isfile(os.path.join(origin_hf_dir, "config.json")):
        raise FileNotFoundError(f"the HF config to write next to the weights: {origin_hf_dir!r} has no config.json")
    shutil.copy2(os.path.join(origin_hf_dir, "config.json"), os.path.join(path, "config.json"))
    for name in TOKENIZER_FILES:
        src = os.path.join(origin_hf_dir, name)
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(path, name))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SAFETENSORS_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().cpu().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, part in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
