"""FSDP trainer checkpoints and HF export: `model.safetensors` (full state, HF names), `optimizer.pt`,
`rng_rank{r}.json`, `trainer_meta.json`; full state dicts load at another data-parallel size, and loading runs no
code from the files."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.fsdp_utils.hf_weights import full_state_dict, write_hf_dir
from slime.utils import checkpoint as driver_ckpt
from slime.utils.safe_load import CheckpointFileError, check_safetensors, read_json_file, safe_torch_load

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
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    rank = dist.get_rank()
    model_sd = full_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_options())
    if rank == 0:
        write_hf_dir(model, model_sd, path, None)  # config and weights; the tokenizer is the run's
        torch.save(optim_sd, os.path.join(path, "optimizer.pt"))
        with open(os.path.join(path, "trainer_meta.json"), "w") as f:
            json.dump({"format_version": FORMAT_VERSION, "world_size": dist.get_world_size(),
                       "hf_checkpoint": hf_checkpoint}, f)
    dist.barrier()  # the directory exists before the other ranks write into it
    with open(os.path.join(path, f"rng_rank{rank}.json"), "w") as f:
        json.dump(rng_state(), f)
    dist.barrier()


def _read_on_rank0(path: str, model: nn.Module, with_optimizer: bool) -> tuple[dict, dict, tuple | None]:
    """Rank 0 reads (and checks) the model and optimizer files; returns (model sd, optim sd, (file, cause) or None)."""
    from safetensors.torch import load_file

    model_file = os.path.join(path, "model.safetensors")
    try:
        check_safetensors(model_file)
        try:
            model_sd = load_file(model_file)
        except Exception as e:  # noqa: BLE001 - a corrupt body the header check could not see
            raise CheckpointFileError(model_file, f"corrupt ({type(e).__name__}: {e})") from None
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in model_sd:
            model_sd["lm_head.weight"] = model_sd["model.embed_tokens.weight"]
        optim_sd = safe_torch_load(os.path.join(path, "optimizer.pt")) if with_optimizer else {}
    except CheckpointFileError as e:
        return {}, {}, (e.path, e.cause)
    return model_sd, optim_sd, None


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Collective. Rank 0 reads the files and broadcasts into the shards; a bad file fails every rank
    with a `CheckpointFileError` naming it (never a hang on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rank = dist.get_rank()
    model_sd, optim_sd, error = _read_on_rank0(path, model, optimizer is not None) if rank == 0 else ({}, {}, None)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointFileError(*box[0])
    set_model_state_dict(model, model_sd, options=_options(broadcast_from_rank0=True))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_sd, options=_options(broadcast_from_rank0=True))
    state = read_rng_file(path, rank)
    if state is not None:
        set_rng_state(state)
    else:
        logger.warning("%s: no RNG state for rank %d (saved at another world size); keeping the seeded RNG",
                       path, rank)
    dist.barrier()


def read_rng_file(path: str, rank: int) -> dict | None:
    """Rank `rank`'s RNG state from `rng_rank{rank}.json` (or an older `.pt`, read without code); None if absent."""
    json_file = os.path.join(path, f"rng_rank{rank}.json")
    if os.path.exists(json_file):
        return read_json_file(json_file)
    pt_file = os.path.join(path, f"rng_rank{rank}.pt")
    if not os.path.exists(pt_file):
        return None
    import numpy as np
    import numpy.dtypes
    from numpy._core.multiarray import _reconstruct

    old = safe_torch_load(pt_file, allowed_globals=[np.ndarray, np.dtype, _reconstruct, numpy.dtypes.UInt32DType])
    kind, keys, pos, has_gauss, cached = old["numpy"]
    version, internal, gauss = old["python"]
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": old["torch"].tolist()}
    if "cuda" in old:
        state["cuda"] = old["cuda"].tolist()
    return state


def rng_state() -> dict:
    """This rank's RNG state, JSON-serialisable (the driver's format, plus CUDA's on a GPU)."""
    state = driver_ckpt.rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    driver_ckpt.set_rng_state(state)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
