"""Megatron-core trainer (`--train-backend megatron`): the FSDP trainer's interface, on GPU (NCCL, bf16) and on
CPU (gloo, through `cpu_shim`, applied only where CUDA is absent). `actor.MegatronTrainer` is one rank; the rest
builds the GPTModel from a HF config, maps HF ⇄ Megatron weights and keeps checkpoints."""

from __future__ import annotations

import warnings

# megatron-core says so at import, once per module, in every process: we do not use apex / TE on purpose
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"full scope is deprecated", category=UserWarning)
