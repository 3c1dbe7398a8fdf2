"""Process-group setup, model loading and FSDP2 sharding, and the teacher-forced
log-prob forward shared by the old-policy, reference and training passes."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.training_utils.data import Batch, TrainItem, collate, response_slices
from slime.backends.training_utils.distributed import device, free_port, init_distributed, use_cuda  # noqa: F401
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs

logger = logging.getLogger(__name__)


def load_hf_model(path: str, attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--hf-checkpoint / --ref-load: {path!r} is not a directory with a HF model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    for attr in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        mod = model
        try:
            for part in attr.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        return list(mod)
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2: one unit per decoder layer plus the root (embeddings, norm, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    model.to(device())
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_model(path: str, trainable: bool, attn_implementation: str = "sdpa") -> nn.Module:
    model = load_hf_model(path, attn_implementation)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    return shard_model(model)


def forward_items(
    model: nn.Module,
    items: list[TrainItem],
    pad_id: int,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, torch.Tensor]:
    """Teacher-forced forward on one micro-batch. Returns per-item response
    log-probs [R] (log_softmax(logits / T) at the taken token), per-item
    entropies (or None) and the full logits (for keeping the graph alive)."""
    batch: Batch = collate(items, pad_id, device())
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    log_probs, entropies = [], [] if with_entropy else None
    for lg, tok in response_slices(logits, batch):
        log_probs.append(compute_log_probs(lg, tok, temperature))
        if with_entropy:  # a metric only, unless the loss has an entropy term
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                entropies.append(compute_entropy_from_logits(lg if entropy_grad else lg.detach(), temperature))
    return log_probs, entropies, logits
