"""Megatron's process groups on top of the default one and the seeds (the CPU shim first where CUDA is absent)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.backends.training_utils.distributed import device, init_distributed, use_cuda

logger = logging.getLogger(__name__)


def prepare_platform() -> None:
    """Before any megatron object exists: the CPU shim where CUDA is absent."""
    if not use_cuda():
        from slime.backends.megatron_utils import cpu_shim

        cpu_shim.apply()


@dataclass(frozen=True)
class Layout:
    world_size: int
    rank: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int

    @property
    def is_weight_source(self) -> bool:
        """The ranks that gather weights for the engines: data-parallel replica 0."""
        return self.dp_rank == 0


def init_parallel(rank: int, world_size: int, master_addr: str, master_port: int, tp: int, seed: int,
                  listen_host: str = "127.0.0.1", listen_sock=None) -> tuple[Layout, bool]:
    """Default group (its store on `listen_host` / `listen_sock`, see `init_distributed`) + megatron's TP/DP
    groups + seeds. Returns (layout, whether this call created the default group)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    prepare_platform()
    owns_pg = init_distributed(rank, world_size, master_addr, master_port, listen_host=listen_host,
                               listen_sock=listen_sock)
    if mpu.model_parallel_is_initialized():
        if mpu.get_tensor_model_parallel_world_size() != tp:
            mpu.destroy_model_parallel()
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                      context_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    layout = Layout(world_size=world_size, rank=rank, tp_size=mpu.get_tensor_model_parallel_world_size(),
                    tp_rank=mpu.get_tensor_model_parallel_rank(), dp_size=mpu.get_data_parallel_world_size(),
                    dp_rank=mpu.get_data_parallel_rank())
    logger.info("rank %d/%d: megatron TP %d (rank %d) x DP %d (rank %d) on %s", rank, world_size, layout.tp_size,
                layout.tp_rank, layout.dp_size, layout.dp_rank, device())
    return layout, owns_pg


def destroy_parallel(owns_pg: bool) -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if owns_pg and dist.is_initialized():
        dist.destroy_process_group()


def tp_group():
    from megatron.core import parallel_state as mpu

    return mpu.get_tensor_model_parallel_group()

