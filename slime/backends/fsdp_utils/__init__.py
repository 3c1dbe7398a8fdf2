"""FSDP2 + transformers trainer (gloo on CPU, NCCL on GPU).

- `actor.FSDPTrainer`: one data-parallel rank (a Ray actor via RayTrainGroup), on the shared
  trainer skeleton (`training_utils.trainer`).
- `model`: load + FSDP2 sharding (bf16 mixed precision with --bf16), packed-aware attention,
  the forward through the chunked log-prob head.
- data and loss: shared with Megatron, in slime.backends.training_utils.
- `update_weight.WeightUpdater`: weights → engines (broadcast group or disk).
- `checkpoint`: save / load / HF export.
"""
