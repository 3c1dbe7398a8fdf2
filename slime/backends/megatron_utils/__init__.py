"""Megatron-core trainer (GPU only): not built yet.

megatron-core's forward, optimizer and schedules call CUDA unconditionally,
so this backend can only run on a GPU machine; until it is written,
`--train-backend megatron` fails here with a message that says what to use.
"""

from __future__ import annotations


class MegatronNotAvailable(NotImplementedError):
    pass


def megatron_trainer_class():
    import torch

    why = ("the Megatron-core trainer is not built yet" if torch.cuda.is_available()
           else "Megatron-core needs CUDA and this machine has no GPU; the Megatron-core trainer is also not built yet")
    raise MegatronNotAvailable(f"--train-backend megatron: {why}; use --train-backend fsdp (FSDP2, CPU or GPU)")
