"""FSDP2 + transformers trainer (gloo on CPU, NCCL on GPU): `actor.FSDPTrainer` is one data-parallel rank on the
shared trainer skeleton (`training_utils`); `model` loads and shards, `checkpoint` saves, loads and exports."""
