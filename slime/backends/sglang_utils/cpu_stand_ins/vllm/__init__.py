"""Stand-in for `vllm` in SGLang's CPU server process: only `vllm._custom_ops.rotary_embedding` (see ../README.md)."""
