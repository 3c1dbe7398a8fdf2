"""The engine object behind the HTTP server: model, tokenizer, scheduler, weight version."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import types
from dataclasses import dataclass

import torch

from slime.backends.hf_engine import pause, tensor_payload, weights
from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING, BUCKET_MIN_SAVING_GPU
from slime.backends.hf_engine.device import resolve_device, resolve_dtype
from slime.backends.hf_engine.fused_norms import fuse_rms_norms
from slime.backends.hf_engine.logprobs import LogprobRecord
from slime.backends.hf_engine.memory import EngineMemory
from slime.backends.hf_engine.onednn_linear import use_onednn_linears
from slime.backends.hf_engine.scheduler import Request, Scheduler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tokenizer_path: str | None = None
    dtype: str = "auto"  # auto: float32 on the CPU, the checkpoint's dtype on a GPU (see resolve_dtype)
    device: str = "auto"  # auto: cuda when a GPU is visible, else cpu (see resolve_device)
    max_running_requests: int = 128
    max_total_tokens: int = 262144
    max_prefill_tokens: int = 8192  # prefill tokens per engine step, over all rows
    chunked_prefill_size: int = 512  # prefill tokens of one request per step (-1: its whole prompt)
    block_size: int = 32  # positions per KV block
    seed: int | None = None
    weight_version: str = "0"
    attn_implementation: str = "sdpa"
    prefix_cache: bool = True  # keep aborted requests' KV for their resumption (flushed with the weights)
    memory_saver: bool = False  # SGLang's --enable-memory-saver: /release_memory_occupation frees memory
    weights_cpu_backup: bool = False  # SGLang's --enable-weights-cpu-backup: released weights kept in host memory
    bucket_min_saving: int | None = None  # key positions a new decode bucket must save (None: by device, buckets.py)
    # decode-only steps from CUDA graphs (decode_graphs.py): auto (capture on cuda, off on cpu), capture, static, off
    cuda_graph: str = "auto"
    cuda_graph_max_bs: int = 128  # SGLang's --cuda-graph-max-bs: larger decode steps run eagerly
    # decode rows and prefill chunks in one forward ("mixed") or two ("separate"; auto: separate on cuda, see scheduler)
    step_composition: str = "auto"


@dataclass(frozen=True)
class UpdateResult:
    message: str
    in_flight: int  # requests in flight across the update (SGLang's reply field num_paused_requests)
    flushed: bool  # False: a flush was asked and refused (requests held in place): the update failed after loading


class EngineUnavailable(RuntimeError):
    """The engine cannot generate now (its memory is released); the message says what to do."""


def load_model(path: str, dtype: str, attn_implementation: str, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model-path: {path!r} is not a directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else weights.parse_dtype(dtype),
                                                 attn_implementation=attn_implementation)
    model.eval()
    return model.to(device)


def _next_version(current: str) -> str:
    try:
        return str(int(current) + 1)
    except ValueError:
        return current


class Engine:
    def __init__(self, cfg: EngineConfig):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the scheduler thread's current device, and IPC handles' target
        self.model = load_model(cfg.model_path, self.dtype, cfg.attn_implementation, self.device)
        self.dtype = str(self.model.dtype).removeprefix("torch.")
        fused = fuse_rms_norms(self.model)  # one op per norm instead of eight (see fused_norms)
        onednn = use_onednn_linears(self.model)
        logger.info("model on %s in %s (%d RMSNorm layers as torch's rms_norm, %d linear layers on oneDNN)",
                    self.device, self.dtype, fused, onednn)
        tok_path = cfg.tokenizer_path or cfg.model_path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self.model_path = cfg.model_path
        self.tokenizer_path = tok_path
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.scheduler = Scheduler(
            self.model,
            self.tokenizer,
            max_running=cfg.max_running_requests,
            max_total_tokens=cfg.max_total_tokens,
            max_prefill_tokens=cfg.max_prefill_tokens,
            seed=cfg.seed,
            chunked_prefill_size=cfg.chunked_prefill_size,
            block_size=cfg.block_size,
            prefix_cache_tokens=None if cfg.prefix_cache else 0,
            attention_kernel=cfg.attn_implementation,
            weight_version=cfg.weight_version,
            bucket_min_saving=cfg.bucket_min_saving if cfg.bucket_min_saving is not None else
            BUCKET_MIN_SAVING if self.device.type == "cpu" else BUCKET_MIN_SAVING_GPU,
            cuda_graph=cfg.cuda_graph, cuda_graph_max_bs=cfg.cuda_graph_max_bs,
            step_composition=cfg.step_composition if cfg.step_composition != "auto" else
            "separate" if self.device.type == "cuda" else "mixed",
        )
        logger.info("decode steps: CUDA graphs %s", {
            "capture": f"captured per padded shape (up to {cfg.cuda_graph_max_bs} rows)",
            "static": "off; steps padded to the graphs' shapes", "off": "off"}[self.scheduler.batch.graphs.mode]
                    + f"; decode rows and prefill chunks in {self.scheduler.step_composition} forwards")
        self.memory = EngineMemory(self.model, self.scheduler, cfg.memory_saver, cfg.weights_cpu_backup)
        self.groups = weights.WeightUpdateGroups()
        self._update_lock = asyncio.Lock()

    @property
    def weight_version(self) -> str:
        """The version of the loaded weights (set on the scheduler thread: see `set_weight_version`)."""
        return self.scheduler.weight_version

    async def set_weight_version(self, version: str) -> None:
        await self.call(self.scheduler.set_weight_version, str(version))

    def start(self) -> None:
        self.scheduler.start()

    def shutdown(self) -> None:
        self.scheduler.stop()
        self.groups.destroy_all()

    async def call(self, fn, *args, timeout: float = 600.0):
        """Run fn(*args) on the scheduler thread at the next step boundary."""
        return await asyncio.wait_for(asyncio.wrap_future(self.scheduler.submit(fn, *args)), timeout)

    def admit(self, req: Request) -> None:
        """Scheduler thread: queue `req`, unless the engine's memory is released (checked in the same step as a
        release, so no request slips in between)."""
        blocker = self.memory.generation_blocker()
        if blocker is not None:
            raise EngineUnavailable(blocker)
        self.scheduler._add(req)

    async def release_memory(self, tags: list[str]) -> str:
        async with self._update_lock:
            return await self.call(self.memory.release, tags)

    async def resume_memory(self, tags: list[str]) -> str:
        async with self._update_lock:
            return await self.call(self.memory.resume, tags)

    def make_request(self, inp, stream: bool, on_event) -> Request:
        gen = None
        if inp.params.sampling_seed is not None:
            gen = torch.Generator()
            gen.manual_seed(int(inp.params.sampling_seed))

        def notify(r: Request, finished: bool) -> None:
            extra = r.logprobs_extra
            snap = types.SimpleNamespace(
                rid=r.rid, input_ids=r.input_ids, params=r.params, output_ids=list(r.output_ids),
                logprobs=list(r.logprobs), finish_reason=copy.copy(r.finish_reason), cached_tokens=r.cached_tokens,
                version_spans=list(r.version_spans), logprobs_extra=None if extra is None else extra.snapshot(),
                created=r.created, retractions=r.retractions,
            )
            on_event(snap, finished)

        extra = LogprobRecord(inp.logprobs) if inp.return_logprob and inp.logprobs.any else None
        return Request(rid=inp.rid, input_ids=inp.input_ids, params=inp.params, stream=stream, notify=notify, generator=gen,
                       logprobs_extra=extra, extra_key=inp.extra_key)

    # ---- weights ---------------------------------------------------------------------
    def _apply(self, named: dict, version: str | None, flush_cache: bool) -> UpdateResult:
        """On the scheduler thread, between two steps: copy, set the version, flush if asked (`pause.update`). Tokens
        sampled before this point keep the old version in `meta_info.weight_versions`, later ones get the new one."""
        sched = self.scheduler
        if self.memory.weights_released:
            raise ValueError("the weights are released (/release_memory_occupation); POST /resume_memory_occupation "
                             "with tags [\"weights\"] before updating them")

        def load() -> None:
            weights.copy_into_model(self.model, named)
            self.memory.note_loaded(named)

        held = sched.paused
        version = version if version is not None else _next_version(sched.weight_version)
        n_running, in_flight, flushed = pause.update(sched, load, version, flush_cache)
        how = "held as the pause left them" if held else "recomputed on the new weights"
        return UpdateResult(f"loaded {len(named)} tensors; weight_version={sched.weight_version}; {n_running} running "
                            f"requests {how}, {in_flight} requests in flight", in_flight, flushed)

    async def update_from_tensors(self, named: dict, version: str | None, flush_cache: bool, abort_all: bool) -> UpdateResult:
        if abort_all:
            await self.call(self.scheduler.abort, None, "aborted for a weight update")
        return await self.call(self._apply, named, version, flush_cache)

    async def update_from_disk(self, model_path: str, version: str | None, flush_cache: bool, abort_all: bool) -> UpdateResult:
        async with self._update_lock:
            named = await asyncio.to_thread(weights.read_state_dict, model_path, self.model.dtype)
            out = await self.update_from_tensors(named, version, flush_cache, abort_all)
            self.model_path = model_path
            return out

    async def update_from_tensor(self, serialized, load_format, version, flush_cache, abort_all) -> UpdateResult:
        """SGLang's /update_weights_from_tensor: the tensors are mapped from the sender's memory (shared memory
        or CUDA IPC), copied into the model between two steps, and released before the reply."""
        async with self._update_lock:
            pairs = await asyncio.to_thread(tensor_payload.decode, serialized, load_format)
            named = dict(pairs)
            if len(named) != len(pairs):
                raise tensor_payload.PayloadError("serialized_named_tensors: a tensor name appears twice")
            try:
                return await self.update_from_tensors(named, version, flush_cache, abort_all)
            finally:
                del named, pairs  # unmap the sender's memory

    async def update_from_distributed(self, group_name: str, names, dtypes, shapes, version, flush_cache, abort_all) -> UpdateResult:
        async with self._update_lock:
            named = await asyncio.to_thread(self.groups.receive, group_name, names, dtypes, shapes)
            return await self.update_from_tensors(named, version, flush_cache, abort_all)
