"""FSDP2 + transformers trainer (gloo on CPU, NCCL on GPU).

- `actor.FSDPTrainer`: one data-parallel rank (a Ray actor via RayTrainGroup).
- `data`: samples → optimizer steps / shards / micro-batches.
- `loss`: advantages, TIS, the per-micro-batch loss.
- `update_weight.WeightUpdater`: weights → engines (broadcast group or disk).
- `checkpoint`: save / load / HF export.
"""
