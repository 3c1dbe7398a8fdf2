"""Embedded rollout engine (CPU, or one CUDA GPU: --device) speaking SGLang's native HTTP API (the routes and
fields SGLang's own server has; where it differs: docs/sglang-compat.md). Run: `python -m slime.backends.hf_engine
--model-path DIR --host 127.0.0.1 --port P` (`--help` lists the rest).

HTTP: `__main__`, `server`, `info`, `http_utils`, `protocol`, `fields`, `weight_routes`. The model: `engine`,
`device`, `fused_norms`, `onednn_linear`, `weights`, `memory`. A step: `scheduler` (one packed forward of decode
tokens and prompt chunks), `request`, `batch`, `kv_pool`, `paged_attention` (the CPU's decode part in
`paged_decode.c`, built by `cpu_decode`), `buckets`, `decode_graphs`, `pause`, `prefix_cache`, `shared_prompts`,
`sampling`, `logprobs`, `stats`. Our own loop returns log_softmax(logits / T) of the raw distribution, per-request
seeds and aborted requests' partial output.
"""
