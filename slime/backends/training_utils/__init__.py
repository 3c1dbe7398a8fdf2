"""What every trainer backend shares (FSDP and Megatron): samples → train
items, optimizer-step / data-parallel / micro-batch plans (`data`), and the
advantages, off-policy correction and per-micro-batch loss (`loss`)."""
