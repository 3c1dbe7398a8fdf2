"""Embedded rollout engine (CPU, or one CUDA GPU: --device) speaking SGLang's native HTTP API (the routes and
fields SGLang's own server has: docs/sglang-compat.md).

    python -m slime.backends.hf_engine --model-path DIR --host 127.0.0.1 --port P \
        [--num-threads 1] [--max-running-requests N] [--max-total-tokens T | --kv-blocks B --block-size S] \
        [--max-prefill-tokens N] [--chunked-prefill-size 512] [--seed S] [--weight-version 0] [--device auto|cpu|cuda[:N]] [--dtype auto]

Modules: `__main__` (CLI), `server` (generate and control routes), `info` (read-only routes),
`http_utils`, `engine` (model + scheduler + weight version), `device` (--device, --dtype, host-to-device copies), `scheduler` (continuous batching thread:
one packed step of decode tokens and prompt chunks at a time; `request`: one request's state and what ends
it), `batch` (rows over a paged KV cache, the
packed forward), `kv_pool` (KV blocks), `paged_attention` (attention over the pool; on the CPU its decode part in
`paged_decode.c`, built on first use by `cpu_decode`), `prefix_cache` (aborted requests' blocks), `shared_prompts`
(a group's samples on one prompt's KV), `stats` (the scheduler's counters), `sampling`, `logprobs` (prompt / top-k / chosen-id
log-probs), `fields` (what is done with every SGLang request field), `protocol` (request validation,
response shapes), `weights` (disk / broadcast updates, the weight-update group and session), `testing` (subprocess helper for tests and benchmarks).
See docs/sglang-compat.md for where it differs from SGLang.

Why our own decode loop rather than transformers' continuous batching: that one was ~3x slower on the tiny
models, its log-probs are of the processed (renormalised top-k/top-p) distribution, it has no per-request seeds,
and a cancelled request loses its partial output. Our loop returns log_softmax(logits / T) exactly.
"""
