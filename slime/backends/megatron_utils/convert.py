"""HF directory ⇄ Megatron torch_dist checkpoint (the conversion tools and `tools/export_hf.py`); under torchrun
the ranks split the work as TP ranks."""

from __future__ import annotations

import json
import logging
import os

import torch

from slime.backends.megatron_utils import checkpoint as ckpt
from slime.backends.megatron_utils import parallel
from slime.backends.megatron_utils.model import build_gpt, load_hf
from slime.backends.megatron_utils.update_weight import gather_hf_weights
from slime.backends.training_utils.weight_sync import write_hf_dir
from slime.backends.training_utils.distributed import free_port
from slime.utils.model_shape import flag_mismatches, read_shape

logger = logging.getLogger(__name__)


def _init(tp: int):
    """A process group from torchrun's environment, else a single process."""
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if world > 1 else free_port()  # torchrun's rendezvous, or our own
    return parallel.init_parallel(rank, world, addr, port, tp if world > 1 else 1, seed=0)


def hf_to_torch_dist(args, hf_dir: str, save_dir: str) -> str:
    """`save_dir/iter_0000000/` (the model, as {"model": ...}) + the tracker file. Returns the iter dir.
    `args`: the Megatron flags (`slime.arguments.megatron_flags`)."""
    shape = read_shape(hf_dir)
    errors = flag_mismatches(args, shape, os.path.join(hf_dir, "config.json"))
    if errors:
        raise ValueError("model-shape flags: " + "; ".join(errors))
    layout, owns = _init(args.tensor_model_parallel_size)
    try:
        built = build_gpt(args, shape, layout.tp_size, trainable=False, wrap_ddp=False)
        load_hf(built, hf_dir, layout.tp_rank, layout.tp_size)
        out = os.path.join(save_dir, "iter_0000000")
        ckpt.save_model(built, out)
        if layout.rank == 0:
            with open(os.path.join(save_dir, ckpt.TRACKER), "w") as f:
                f.write("0")
        torch.distributed.barrier()
        logger.info("wrote %s (%s, TP %d)", out, "bf16" if args.bf16 else "fp32", layout.tp_size)
        return out
    finally:
        parallel.destroy_parallel(owns)


def _hf_dtype(hf_dir: str) -> torch.dtype | None:
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return getattr(torch, name) if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else None


def torch_dist_to_hf(flags, input_dir: str, output_dir: str, origin_hf_dir: str) -> str:
    """A HF directory (config + tokenizer of `origin_hf_dir`, weights in its dtype) from a torch_dist checkpoint
    (a converter's, a `train.py --save` iter dir or a trainer dir)."""
    if ckpt.model_dir_of(input_dir) is None:
        raise FileNotFoundError(f"--input-dir {input_dir!r}: no megatron model checkpoint (metadata.json) in it")
    shape = read_shape(origin_hf_dir)
    layout, owns = _init(1)
    try:
        built = build_gpt(flags, shape, layout.tp_size, trainable=False, wrap_ddp=False)
        ckpt.load_model(built, input_dir)
        dtype = _hf_dtype(origin_hf_dir)
        state = {k: (v.to(dtype) if dtype is not None else v) for k, v in gather_hf_weights(built, layout)}
        if layout.rank == 0:
            write_hf_dir(state, output_dir, origin_hf_dir)
        logger.info("wrote %s (%d tensors)", output_dir, len(state))
        return output_dir
    finally:
        parallel.destroy_parallel(owns)
