"""CLI: python -m slime.backends.hf_engine --model-path DIR --host 127.0.0.1 --port P [...]."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

logger = logging.getLogger("slime.backends.hf_engine")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime.backends.hf_engine", description="Embedded engine (CPU or CUDA) speaking SGLang's HTTP API.")
    p.add_argument("--model-path", required=True, help="Hugging Face model directory (model + tokenizer).")
    p.add_argument("--tokenizer-path", default=None, help="Tokenizer directory (default: --model-path).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (default 127.0.0.1).")
    p.add_argument("--port", type=int, default=30000, help="Port (default 30000).")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads (default 1).")
    p.add_argument("--device", default="auto",
                   help="Where the model, its KV cache and sampling run: auto (default: cuda when a GPU is visible, "
                        "else cpu), cpu, cuda or cuda:N (SGLang's flag).")
    p.add_argument("--dtype", default="auto",
                   help="Model dtype: auto (default: float32 on cpu; on cuda the checkpoint's own, e.g. bfloat16 for Qwen3), "
                        "float32, bfloat16, float16.")
    p.add_argument("--max-running-requests", type=int, default=128, help="Max requests in the decode batch.")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV budget in tokens: sum over running requests of prompt + max_new_tokens (default 262144).")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV budget as blocks (x --block-size); overrides --max-total-tokens.")
    p.add_argument("--block-size", type=int, default=32,
                   help="Positions per block of the paged KV cache (and the unit of --kv-blocks; default 32).")
    p.add_argument("--max-prefill-tokens", type=int, default=8192,
                   help="Max prompt tokens prefilled in one engine step, over all requests (default 8192).")
    p.add_argument("--chunked-prefill-size", type=int, default=512,
                   help="Max prompt tokens of one request prefilled per step; a longer prompt is prefilled in chunks "
                        "alongside the decoding requests (-1: no chunking; default 512).")
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="Do not keep aborted requests' KV for the requests that resume them (SGLang's flag name).")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="Let /release_memory_occupation free the weights' and KV cache's memory (SGLang's flag).")
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="Keep released weights in host memory and restore them on resume (SGLang's flag); without "
                        "it resumed weights wait for the next weight update.")
    p.add_argument("--seed", type=int, default=None, help="Seed of the server's sampling generator.")
    p.add_argument("--weight-version", default="default",
                   help="Initial weight_version string (default 'default', as SGLang; the launcher passes 0).")
    p.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"], help="Attention kernel.")
    p.add_argument("--bucket-min-saving", type=int, default=None,
                   help="Key positions a new decode attention bucket must save (rows of very different lengths are "
                        "split into buckets; default 2048 on cpu, 16384 on cuda).")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="Run every decode step eagerly (SGLang's flag; the same as --cuda-graph-mode off).")
    p.add_argument("--cuda-graph-max-bs", type=int, default=128,
                   help="Decode steps of up to this many rows replay CUDA graphs; larger ones run eagerly (SGLang's "
                        "flag; default 128).")
    p.add_argument("--cuda-graph-mode", choices=["auto", "capture", "static", "off"], default="auto",
                   help="auto (default): decode-only steps replay CUDA graphs on cuda, none on cpu; capture: the same, "
                        "required; static: the graphs' padded static-buffer step run eagerly (what the CPU can check); "
                        "off: as --disable-cuda-graph.")
    p.add_argument("--step-composition", choices=["auto", "mixed", "separate"], default="auto",
                   help="auto (default): separate on cuda, mixed on cpu; mixed: a step's decode rows and prefill chunks "
                        "in one forward; separate: in two (SGLang's default), so every decode forward replays its "
                        "CUDA graph.")
    p.add_argument("--enable-mixed-chunk", action="store_true",
                   help="SGLang's flag: the same as --step-composition mixed.")
    p.add_argument("--log-level", default="INFO", help="Logging level.")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name, value in (("--num-threads", args.num_threads), ("--max-running-requests", args.max_running_requests),
                        ("--max-prefill-tokens", args.max_prefill_tokens), ("--block-size", args.block_size)):
        if value < 1:
            logger.error("%s must be >= 1, got %s", name, value)
            return 2
    if args.bucket_min_saving is not None and args.bucket_min_saving < 0:
        logger.error("--bucket-min-saving must be >= 0, got %s", args.bucket_min_saving)
        return 2
    if args.cuda_graph_max_bs < 1:
        logger.error("--cuda-graph-max-bs must be >= 1, got %s", args.cuda_graph_max_bs)
        return 2
    if args.disable_cuda_graph and args.cuda_graph_mode not in ("auto", "off"):
        logger.error("--disable-cuda-graph contradicts --cuda-graph-mode %s", args.cuda_graph_mode)
        return 2
    if args.enable_mixed_chunk and args.step_composition == "separate":
        logger.error("--enable-mixed-chunk contradicts --step-composition separate")
        return 2
    if args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1:
        logger.error("--chunked-prefill-size must be -1 (no chunking) or >= 1, got %s", args.chunked_prefill_size)
        return 2
    if not os.path.isdir(args.model_path):
        logger.error("--model-path: %r is not a directory", args.model_path)
        return 2
    import torch

    torch.set_num_threads(args.num_threads)
    from slime.backends.hf_engine.decode_graphs import GraphModeError
    from slime.backends.hf_engine.device import DeviceError
    from slime.backends.hf_engine.engine import Engine, EngineConfig
    from slime.backends.hf_engine.server import serve

    total = args.max_total_tokens or 262144
    if args.kv_blocks is not None:
        total = args.kv_blocks * args.block_size
    cfg = EngineConfig(
        model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype, device=args.device,
        max_running_requests=args.max_running_requests, max_total_tokens=total,
        max_prefill_tokens=args.max_prefill_tokens, seed=args.seed, weight_version=args.weight_version,
        attn_implementation=args.attn_implementation, chunked_prefill_size=args.chunked_prefill_size,
        block_size=args.block_size, prefix_cache=not args.disable_radix_cache, memory_saver=args.enable_memory_saver,
        weights_cpu_backup=args.enable_weights_cpu_backup, bucket_min_saving=args.bucket_min_saving,
        cuda_graph="off" if args.disable_cuda_graph else args.cuda_graph_mode, cuda_graph_max_bs=args.cuda_graph_max_bs,
        step_composition="mixed" if args.enable_mixed_chunk else args.step_composition,
    )
    try:
        engine = Engine(cfg)
    except (FileNotFoundError, DeviceError, GraphModeError) as e:
        logger.error("%s", e)
        return 2
    except Exception as e:  # noqa: BLE001 - a clear message and a non-zero exit
        logger.error("failed to load model from --model-path %r: %s", args.model_path, e)
        return 1
    asyncio.run(serve(engine, args.host, args.port))
    logger.info("hf_engine stopped")
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is released by now (scheduler joined, groups destroyed, sockets closed); skip the slow
    # interpreter teardown of torch/transformers (seconds on a loaded box).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
