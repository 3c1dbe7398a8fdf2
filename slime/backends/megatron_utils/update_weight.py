"""Megatron weights -> the engines, under HF names, through `training_utils/weight_sync`: the TP ranks of
data-parallel replica 0 all-gather each parameter, global rank 0 converts it to HF names and buckets it; other
replicas skip.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist

from slime.backends.megatron_utils import hf_weights
from slime.backends.megatron_utils.model import Built, named_local_params
from slime.backends.megatron_utils.parallel import Layout, tp_group
from slime.backends.training_utils.weight_sync import WeightUpdater, write_hf_dir

logger = logging.getLogger(__name__)


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
    """Collective: HF-named tensors on the trainer's device on global rank 0, or with `everywhere` on every rank
    (tensor sync); other ranks take part in the gathers and yield nothing."""
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
