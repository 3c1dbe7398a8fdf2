"""Trainer checkpoints and HF export.

Layout of a checkpoint directory (written into the target dir the caller
gives; the caller makes it atomic by writing into a tmp dir and renaming):

    model.safetensors     full (unsharded) model state, HF parameter names
    optimizer.pt          full optimizer state keyed by parameter name
    rng_rank{r}.pt        python / torch RNG state of each trainer rank
    trainer_meta.json     world size, format version

Full state dicts keyed by parameter name do not depend on the sharding, so
a checkpoint saved at one data-parallel world size loads at another (the RNG
state of ranks that did not exist is left as seeded).
"""

from __future__ import annotations

import json
import logging
import os
import random

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.fsdp_utils.hf_weights import full_state_dict, untie_for_safetensors, write_hf_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def export_hf(model: nn.Module, path: str, hf_checkpoint: str | None) -> None:
    """Collective (every rank calls it); rank 0 writes the HF directory."""
    state = full_state_dict(model)
    if dist.get_rank() == 0:
        write_hf_dir(model, state, path, hf_checkpoint)
    dist.barrier()


def save(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, hf_checkpoint: str | None = None) -> None:
    """Collective. Model + optimizer (full, from rank 0) and every rank's RNG."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    rank = dist.get_rank()
    model_sd = get_model_state_dict(model, options=_options())
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_options())
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        save_file(untie_for_safetensors(model, model_sd), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        torch.save(optim_sd, os.path.join(path, "optimizer.pt"))
        model.config.save_pretrained(path)
        with open(os.path.join(path, "trainer_meta.json"), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "world_size": dist.get_world_size(),
                       "hf_checkpoint": hf_checkpoint}, f)
    dist.barrier()  # the directory exists before the other ranks write into it
    torch.save(rng_state(), os.path.join(path, f"rng_rank{rank}.pt"))
    dist.barrier()


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Collective. Rank 0 reads the files and broadcasts into the shards."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rank = dist.get_rank()
    model_file = os.path.join(path, "model.safetensors")
    ok = torch.tensor([int(os.path.exists(model_file)) if rank == 0 else 1])
    dist.broadcast(ok, src=0)
    if not ok.item():
        raise FileNotFoundError(f"trainer checkpoint {path!r} has no model.safetensors")
    model_sd = {}
    if rank == 0:
        model_sd = load_file(model_file)
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in model_sd:
            model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
    set_model_state_dict(model, model_sd, options=_options(broadcast_from_rank0=True))
    if optimizer is not None:
        optim_sd = torch.load(os.path.join(path, "optimizer.pt"), weights_only=False) if rank == 0 else {}
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_options(broadcast_from_rank0=True))
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    if os.path.exists(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        logger.warning("%s: no RNG state for rank %d (saved at another world size); keeping the seeded RNG",
                       path, rank)
    dist.barrier()


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
