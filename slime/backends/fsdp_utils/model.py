"""Process-group setup, model loading and FSDP2 sharding, and the teacher-forced
log-prob forward shared by the old-policy, reference and training passes."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from slime.backends.fsdp_utils.data import Batch, TrainItem, collate, response_slices
from slime.utils.net import is_loopback, listen_socket, pin_collectives_to_loopback, serve_store
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs

logger = logging.getLogger(__name__)


def use_cuda() -> bool:
    return torch.cuda.is_available()


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 600,
                     listen_host: str = "127.0.0.1", listen_sock: socket.socket | None = None) -> bool:
    """Create the default process group (gloo on CPU, nccl on GPU) unless one
    exists. Returns True when this call created it (so the caller destroys it).

    Rank 0 serves the rendezvous store on `listen_sock` (or a new socket on
    `listen_host`), never on every interface; the others connect to
    `master_addr:master_port`. With a loopback `listen_host` gloo / NCCL
    bootstrap sockets stay on loopback too.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"a default process group already exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"wanted {rank}/{world_size}"
            )
        return False
    timeout = timedelta(seconds=timeout_s)
    if is_loopback(listen_host):
        pin_collectives_to_loopback()
    if rank == 0:
        sock = listen_sock if listen_sock is not None else listen_socket(listen_host, master_port or 0)
        master_port = sock.getsockname()[1]
        store = serve_store(sock, world_size, timeout)
    else:
        store = dist.TCPStore(master_addr, int(master_port), world_size, is_master=False, timeout=timeout)
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if use_cuda() else "gloo"
    if use_cuda():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) if torch.cuda.device_count() > 1 else 0)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    logger.info("rank %d/%d: %s process group on %s:%d", rank, world_size, backend, master_addr, master_port)
    return True


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda() else torch.device("cpu")


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
