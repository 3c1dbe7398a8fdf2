"""FSDP weights → the engines: the trainers' weight sync (`training_utils/weight_sync`) with FSDP's own gathers
(the full state dict on rank 0, or every full tensor streamed on every rank) and HF directory."""

from __future__ import annotations

from typing import Iterable

import torch

from slime.backends.fsdp_utils.hf_weights import full_state_dict, iter_full_weights, write_hf_dir
from slime.backends.training_utils.weight_sync import WeightUpdater


class FSDPWeightUpdater(WeightUpdater):
    def named_weights(self, everywhere: bool = False) -> Iterable[tuple[str, torch.Tensor]]:
        if everywhere:
            return iter_full_weights(self.model)
        return full_state_dict(self.model).items()

    def write_hf(self, state: dict[str, torch.Tensor], path: str) -> None:
        write_hf_dir(self.model, state, path, self.args.hf_checkpoint)
