"""What every trainer backend shares (FSDP and Megatron): the trainer skeleton
(`trainer`: step loop, metrics, offload, shutdown), samples → train items,
optimizer-step / data-parallel / micro-batch plans and padded or packed
micro-batches (`data`), packed attention (`varlen`), the chunked log-prob /
entropy head (`logprob_head`), and the advantages, off-policy correction and
per-micro-batch loss (`loss`)."""
