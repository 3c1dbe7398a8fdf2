"""Megatron weights → the engines, under HF names, through the same
weight-sync paths as FSDP (`fsdp_utils.update_weight.WeightUpdater`: a
broadcast group in buckets, or a HF directory on disk).

Weights stream one parameter at a time: the TP ranks of data-parallel
replica 0 all-gather each shard, global rank 0 converts it to HF names and
hands it to the bucketer; other replicas hold the same weights and skip.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils.hf_weights import TOKENIZER_FILES
from slime.backends.fsdp_utils.update_weight import WeightUpdater
from slime.backends.megatron_utils import hf_weights
from slime.backends.megatron_utils.model import Built, named_local_params
from slime.backends.megatron_utils.parallel import Layout, tp_group

logger = logging.getLogger(__name__)

SAFETENSORS_SHARD_BYTES = 4 * 1024**3


def gather_full(built: Built, layout: Layout, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over each TP group of DP replica 0 (with `everywhere`, of every replica): (Megatron name,
    full tensor) on those ranks, in `megatron_names` order."""
    if not (everywhere or layout.is_weight_source):
        return
    params = named_local_params(built.core)
    group = tp_group()
    for name in hf_weights.megatron_names(built.shape):
        local = params[name].detach()
        if layout.tp_size > 1 and hf_weights.is_tp_split(name):
            parts = [torch.empty_like(local) for _ in range(layout.tp_size)]
            dist.all_gather(parts, local.contiguous(), group=group)
            full = hf_weights.unshard(name, parts)
        else:
            full = local
        yield name, full


def gather_hf_weights(built: Built, layout: Layout, everywhere: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: HF-named tensors (on the trainer's device, so a GPU
    broadcast never round-trips through the host) on global rank 0, or with
    `everywhere` on every rank (tensor sync: each rank feeds the engine on its
    GPU); other ranks take part in the gathers and yield nothing."""
    for name, full in gather_full(built, layout, everywhere):
        if everywhere or layout.rank == 0:
            for hf_name, t in hf_weights.full_to_hf(name, full, built.shape):
                yield hf_name, t.detach().clone(memory_format=torch.contiguous_format)


class MegatronWeightUpdater(WeightUpdater):
    def __init__(self, args, built: Built, layout: Layout):
        super().__init__(args, built.core, layout.rank)
        self.built = built
        self.layout = layout

    def named_weights(self, everywhere: bool = False):
        return gather_hf_weights(self.built, self.layout, everywhere)

    def write_hf(self, state: dict[str, torch.Tensor], path: str) -> None:
        write_hf_dir(state, path, self.args.hf_checkpoint)


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
