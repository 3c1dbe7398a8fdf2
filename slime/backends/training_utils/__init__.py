"""What both trainer backends (FSDP and Megatron) share: the trainer skeleton, data plans and micro-batches,
packed attention, the chunked log-prob head, and the loss."""
