"""FSDP2 + transformers trainer (gloo on CPU, NCCL on GPU).

- `actor.FSDPTrainer`: one data-parallel rank (a Ray actor via RayTrainGroup).
- data and loss: shared with Megatron, in slime.backends.training_utils.
- `update_weight.WeightUpdater`: weights → engines (broadcast group or disk).
- `checkpoint`: save / load / HF export.
"""
