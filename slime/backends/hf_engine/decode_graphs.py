"""Decode steps replayed from CUDA graphs (SGLang's `--disable-cuda-graph` / `--cuda-graph-max-bs`).

A small model's decode step is launch-bound on a GPU; a graph replays it with one launch. Graphs need fixed shapes,
so rows and key blocks are padded to powers of two (`buckets.graph_rows` / `graph_blocks`; padding rows read block
0, which stays finite), and the inputs go through one static buffer per shape. Weights and the KV pool are captured
by address, so graphs are dropped when the pool grows or the memory is released. Modes: "capture", "static" (the
padded forward run eagerly, what the CPU tests check) and "off".
"""

from __future__ import annotations

import logging
import time

import torch

from slime.backends.hf_engine.buckets import graph_blocks, graph_rows
from slime.backends.hf_engine.paged_attention import Bucket, StepPlan

logger = logging.getLogger(__name__)

MODES = ("off", "static", "capture")
WARMUP_RUNS = 1  # eager runs on a side stream before a capture (the engine's eager steps have initialised cuBLAS)


class GraphModeError(ValueError):
    """--cuda-graph-mode names a mode this device cannot run."""


def resolve_mode(mode: str, device: torch.device) -> str:
    """auto: capture on a GPU, off on the CPU (no CUDA graphs there)."""
    if mode == "auto":
        return "capture" if device.type == "cuda" else "off"
    if mode not in MODES:
        raise GraphModeError(f"--cuda-graph-mode: expected auto, {', '.join(MODES)}; got {mode!r}")
    if mode == "capture" and device.type != "cuda":
        raise GraphModeError(f"--cuda-graph-mode capture needs a CUDA device; the engine runs on {device} "
                             f"(static runs the same padded step without capture)")
    return mode


class _Shape:
    """One captured (or static) step shape: its input buffer, its plan and, when captured, its graph."""

    def __init__(self, rows: int, blocks: int, device: torch.device):
        self.rows, self.blocks = rows, blocks
        n = 4 * rows + rows * blocks
        self.inputs = torch.zeros(n, dtype=torch.long, device=device)
        self.staging = torch.zeros(n, dtype=torch.long, pin_memory=device.type == "cuda")
        r = rows
        self.ids, self.pos, self.slots = self.inputs[:r], self.inputs[r:2 * r], self.inputs[2 * r:3 * r]
        self.limit = self.inputs[3 * r:4 * r].view(r, 1)
        self.block_ids = self.inputs[4 * r:]
        self.plan: StepPlan | None = None
        self.graph = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model, pool, mode: str, max_rows: int, kernel: str, prefill: str, step_mask: torch.Tensor):
        self.model, self.pool, self.mode, self.max_rows = model, pool, mode, max_rows
        self.kernel, self.prefill, self.step_mask = kernel, prefill, step_mask
        self.device = step_mask.device
        self._shapes: dict[tuple[int, int], _Shape] = {}
        self._generation: int | None = None
        self._mempool = None
        self.last_plan: StepPlan | None = None  # the last step's (one padded bucket), for the scheduler's counters
        # counters (served with the scheduler's: /get_server_info)
        self.steps = self.captures = 0
        self.capture_s = 0.0
        self.last_capture_s = 0.0  # of the last step: its capture's seconds (not the step's own cost)
        self.failure: str | None = None  # why a capture failed (the mode is "off" since)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        return self.mode if self.failure is None else f"off (capture failed: {self.failure})"

    def counters(self) -> dict:
        return {"cuda_graph_steps": self.steps, "cuda_graph_captures": self.captures,
                "cuda_graph_capture_s": self.capture_s}

    def drop(self) -> int:
        """Forget every shape and free its graph (the weights or the KV pool are about to move); returns how many."""
        n = len(self._shapes)
        self._shapes.clear()
        self._mempool = None
        self.last_plan = None
        return n

    def runs(self, segments, num_layers: int) -> bool:
        """Whether this step runs here: decode-only, every row sampled, at most max_rows rows, and every layer of
        the pool allocated (a capture must not allocate the pool inside its private memory)."""
        return (self.enabled and 0 < len(segments) <= self.max_rows and self.pool.layers_allocated == num_layers
                and all(len(toks) == 1 and sample for _, toks, sample in segments))

    def forward(self, segments, positions: list[int], slots: list[int], tables: torch.Tensor) -> torch.Tensor | None:
        """Logits [len(segments), V] of a decode-only step (row i is segment i's): segment i feeds its token at
        `positions[i]` into KV slot `slots[i]`, its row's blocks in `tables`. None when its capture failed: the
        caller runs the step eagerly, as every later one (the failure is logged and served in /get_server_info)."""
        self.last_capture_s = 0.0
        if self.pool.generation != self._generation:  # the pool grew or was released: its tensors moved
            self.drop()
            self._generation = self.pool.generation
        n, bs = len(segments), self.pool.block_size
        key = (graph_rows(n, self.max_rows), graph_blocks(max(positions) // bs + 1))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = _Shape(*key, self.device)
            shape.plan = StepPlan(self.pool, shape.slots, [Bucket(list(range(key[0])), 1, key[1], shape.block_ids,
                                                                  shape.limit)], self.kernel, self.prefill)
        _fill(shape, segments, positions, slots, tables)
        if self.mode == "static":
            shape.logits = self._run(shape)
        elif shape.graph is None:
            try:
                self._capture(shape)
            except RuntimeError as e:  # an op the capture refuses (its warm-up runs wrote the same KV the step will)
                self.failure = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                logger.error("CUDA graph capture failed (%s); decode steps run eagerly from now on", self.failure)
                self.mode = "off"
                self.drop()
                return None
        else:
            shape.graph.replay()
        self.steps += 1
        self.last_plan = shape.plan
        return shape.logits[:n]

    def _run(self, shape: _Shape) -> torch.Tensor:
        for bk in shape.plan.buckets:  # its mask is built from `limit` inside the run (recorded in a capture)
            bk._masks.clear()
        out = self.model(input_ids=shape.ids.view(1, -1), position_ids=shape.pos.view(1, -1),
                         attention_mask=self.step_mask, use_cache=False, logits_to_keep=0, paged_step=shape.plan)
        return out.logits[0]

    def _capture(self, shape: _Shape) -> None:
        t0 = time.perf_counter()
        current = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):  # the inputs are this step's: the warm-up runs compute (and write) it
            for _ in range(WARMUP_RUNS):
                self._run(shape)
        current.wait_stream(stream)
        if self._mempool is None:  # one memory pool for every shape: only one replays at a time
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the HTTP side's threads may use CUDA meanwhile (opening a weight update's IPC handles)
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            shape.logits = self._run(shape)
        graph.replay()
        shape.graph = graph
        self.captures += 1
        self.last_capture_s = time.perf_counter() - t0
        self.capture_s += self.last_capture_s
        logger.debug("captured a decode step of %d rows x %d key blocks in %.3fs (%d shapes)", shape.rows,
                     shape.blocks, self.last_capture_s, len(self._shapes))


def _fill(shape: _Shape, segments, positions: list[int], slots: list[int], tables: torch.Tensor) -> None:
    """The step's inputs into `shape`'s static buffer, in one copy (from pinned memory on a GPU); padding rows and
    padding blocks are zeros."""
    r, m, n = shape.rows, shape.blocks, len(segments)
    host = shape.staging
    host.zero_()
    host[:n] = torch.tensor([toks[0] for _, toks, _ in segments], dtype=torch.long)
    host[r:r + n] = torch.tensor(positions, dtype=torch.long)
    host[2 * r:2 * r + n] = torch.tensor(slots, dtype=torch.long)
    host[3 * r:3 * r + n] = host[r:r + n]  # a row attends positions 0 .. its own
    w = min(m, tables.shape[1])
    rows = torch.tensor([row for row, _, _ in segments], dtype=torch.long)
    host[4 * r:].view(r, m)[:n, :w] = tables.index_select(0, rows)[:, :w]
    shape.inputs.copy_(host, non_blocking=host.is_pinned())
