"""The trainer model's weights under their HF names, and a plain HF directory written from them (shared by
checkpoints and the weight sync's disk path)."""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from slime.backends.training_utils.weight_sync.hf_dir import TOKENIZER_FILES


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: every rank must call it; only rank 0 gets the tensors (CPU)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def iter_full_weights(model: nn.Module):
    """Collective: every rank gets every (name, full tensor) in turn (one all-gather per tensor)."""
    from torch.distributed.tensor import DTensor

    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            t = t.full_tensor()
        yield name, t.detach()


def write_hf_dir(model: nn.Module, state: dict[str, torch.Tensor], path: str, hf_checkpoint: str | None) -> None:
    """Rank-0 only: a plain HF model directory (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    tied = getattr(model.config, "tie_word_embeddings", False)  # safetensors refuses shared storage: drop the copy
    weights = {k: v.detach().contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")}
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if hf_checkpoint and os.path.isdir(hf_checkpoint):
        for name in TOKENIZER_FILES:
            src = os.path.join(hf_checkpoint, name)
            if os.path.exists(src):
                shutil.copy2(src, os.path.join(path, name))
