"""The engine's running rows over a paged KV cache, and one packed model forward per step.

A row has a block table and `cached`, how many leading positions are in the pool. A step packs every row's next
uncached tokens (one when decoding, a chunk when prefilling) into ONE `[1, N]` forward, so rows of any length share
it without padding. Joining and leaving copy no KV; `share_prefix` starts a row on another's blocks. Block tables
live in one host tensor; a step's metadata goes to the device in one copy.
"""

from __future__ import annotations

from typing import Callable

import torch

from slime.backends.hf_engine import cpu_decode
from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING
from slime.backends.hf_engine.decode_graphs import DecodeGraphs, resolve_mode
from slime.backends.hf_engine.kv_pool import KVPool
from slime.backends.hf_engine.paged_attention import (ATTN_NAME, PREFILL_ATTENTION, StepPlan, move_plan, plan_buckets,
                                                      register, step_mask)

Segment = tuple[int, list[int], bool]  # (row, token ids to feed at its next positions, sample after the last)


class PagedBatch:
    def __init__(self, model, block_size: int = 32, max_tokens: int = 262144, max_rows: int = 128,
                 kernel: str = "sdpa", min_bucket_saving: int = BUCKET_MIN_SAVING, prefill_attention: str = "auto",
                 decode_graphs: str = "off", graph_max_rows: int = 128):
        if kernel not in ("sdpa", "eager"):
            raise ValueError(f"attention kernel must be sdpa or eager, got {kernel!r}")
        self.kernel = kernel
        self.device = next(model.parameters()).device
        if prefill_attention == "auto":  # see paged_attention: the CPU's flash kernel gives the split its edge
            prefill_attention = "split" if self.device.type == "cpu" else "masked"
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention must be auto, split or masked, got {prefill_attention!r}")
        self.prefill_attention = prefill_attention
        self._step_mask = step_mask(self.device)
        self.min_bucket_saving = min_bucket_saving
        register()
        model.set_attn_implementation(ATTN_NAME)
        self.model = model
        self.block_size = block_size
        # every running row wastes less than one block on its last, partly filled one
        self.pool = KVPool(block_size, max_blocks=-(-max_tokens // block_size) + max_rows + 1)
        self.tables = torch.zeros(max(8, max_rows), 16, dtype=torch.long)
        self._blocks: dict[int, list[int]] = {}
        self._cached: dict[int, int] = {}
        self._free_slots: list[int] = list(range(self.tables.shape[0] - 1, -1, -1))
        # called with a number of blocks when the pool runs short (the prefix cache evicts entries)
        self.reclaim: Callable[[int], None] | None = None
        self.last_plan: StepPlan | None = None  # the last step's buckets (for stats and tests)
        # decode-only steps replayed from CUDA graphs ("capture"), or padded the same way without them ("static")
        self.graphs = DecodeGraphs(model, self.pool, resolve_mode(decode_graphs, self.device), graph_max_rows, kernel,
                                   prefill_attention, self._step_mask)
        self._layers = int(model.config.num_hidden_layers)
        # on the CPU, decode buckets attend in the pool (cpu_decode; None: gather + SDPA, as on other devices)
        self.decode_kernel = cpu_decode.load() if self.device.type == "cpu" and kernel == "sdpa" else None

    # ---- rows --------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._blocks)

    def add_row(self, blocks: list[int] | None = None, cached: int = 0) -> int:
        """A new row; with `blocks`, it owns them and its first `cached` positions are already in them."""
        blocks = list(blocks or [])
        if cached > len(blocks) * self.block_size:
            raise ValueError(f"{cached} cached positions do not fit in {len(blocks)} blocks of {self.block_size}")
        if not self._free_slots:
            self._grow_tables(rows=self.tables.shape[0] * 2)
        row = self._free_slots.pop()
        self._blocks[row], self._cached[row] = [], cached
        self._put_blocks(row, blocks)
        return row

    def cached(self, row: int) -> int:
        return self._cached[row]

    def share_prefix(self, row: int, src: int, positions: int) -> None:
        """Start the empty `row` on the KV of `src`'s first `positions` positions: the blocks they fill are shared
        (neither row writes them again: a row writes only past its cached positions), a partly filled last
        block is copied."""
        if self._cached[row] or self._blocks[row]:
            raise ValueError(f"row {row} is not empty")
        if positions > self._cached[src]:
            raise ValueError(f"row {src} has {self._cached[src]} cached positions, not {positions}")
        full, rest = divmod(positions, self.block_size)
        blocks = self._blocks[src][:full]
        self.pool.share(blocks)
        if rest:
            blocks = blocks + self._alloc(1)
            self.pool.copy_block(self._blocks[src][full], blocks[-1])
        self._put_blocks(row, blocks)
        self._cached[row] = positions

    def detach(self, row: int) -> tuple[list[int], int]:
        """Remove `row` and hand its blocks (and cached positions) to the caller, who now owns them."""
        blocks, cached = self._blocks.pop(row), self._cached.pop(row)
        self._free_slots.append(row)
        return blocks, cached

    def drop(self, row: int) -> None:
        """Remove `row` and free its blocks."""
        self.pool.free(self.detach(row)[0])

    def clear(self) -> None:
        for row in list(self._blocks):
            self.drop(row)

    # ---- memory (SGLang's kv_cache tag) ----------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of the KV pool (the running rows' blocks and the prefix cache's are both in it)."""
        return self.pool.nbytes()

    def free_kv(self) -> int:
        """Drop every row and free the pool's storage (the next write allocates it again); the prefix cache must
        have given its blocks back first. Returns the bytes freed."""
        self.clear()
        return self.pool.release()

    # ---- the step ----------------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: tables and pool grown here are updated outside steps too
    def forward(self, segments: list[Segment]) -> torch.Tensor:
        """Feed every segment's tokens at its row's next positions, in one forward; return the logits
        after the last token of each segment marked to sample ([k, V], in segment order)."""
        shapes = []
        for row, toks, _ in segments:
            if not toks:
                raise ValueError(f"row {row}: empty segment")
            p0 = self._cached[row]
            self._reserve(row, p0 + len(toks))
            shapes.append((len(toks), p0, row))
        bs = self.block_size
        if self.graphs.runs(segments, self._layers):
            positions = [p0 for _, p0, _ in shapes]
            slots = [self._blocks[row][p // bs] * bs + p % bs for (row, _, _), p in zip(segments, positions)]
            logits = self.graphs.forward(segments, positions, slots, self.tables)
            if logits is not None:  # (None: the capture failed; this step and every later one run eagerly)
                self.last_plan = self.graphs.last_plan
                for row, _, _ in segments:
                    self._cached[row] += 1
                return logits
        buckets = plan_buckets(shapes, self.tables, bs, self.min_bucket_saving,
                               merge_prefill=self.prefill_attention == "masked")
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []  # pool slot of each packed token: its row's block for the position, and offset
        last = [0] * len(segments)  # packed index of each segment's last token
        for bk in buckets:
            for i in bk.segments:
                row, toks, _ = segments[i]
                q, p0 = shapes[i][0], shapes[i][1]
                blocks = self._blocks[row]
                ids.extend(toks)
                if q == 1:
                    pos.append(p0)
                    slots.append(blocks[p0 // bs] * bs + p0 % bs)
                else:
                    pos.extend(range(p0, p0 + q))
                    p, end = p0, p0 + q
                    while p < end:  # one run of consecutive slots per block
                        stop = min(end, (p // bs + 1) * bs)
                        base = blocks[p // bs] * bs - (p // bs) * bs
                        slots.extend(range(base + p, base + stop))
                        p = stop
                last[i] = len(ids) - 1
        keep = [last[i] for i, seg in enumerate(segments) if seg[2]]
        packed, keep_t = move_plan(buckets, [torch.tensor([ids, pos, slots], dtype=torch.long),
                                             torch.tensor(keep, dtype=torch.long)], self.device)
        plan = self.last_plan = StepPlan(self.pool, packed[2], buckets, self.kernel, self.prefill_attention,
                                         self.decode_kernel)
        out = self.model(input_ids=packed[0:1], position_ids=packed[1:2], attention_mask=self._step_mask,
                         use_cache=False, logits_to_keep=keep_t, paged_step=plan)
        for row, toks, _ in segments:
            self._cached[row] += len(toks)
        return out.logits[0]

    # ---- blocks ------------------------------------------------------------------------
    def _reserve(self, row: int, positions: int) -> None:
        """Give `row` enough blocks for `positions` positions."""
        need = -(-positions // self.block_size) - len(self._blocks[row])
        if need > 0:
            self._put_blocks(row, self._alloc(need))

    def _alloc(self, n: int) -> list[int]:
        if self.pool.num_free < n and self.reclaim is not None:
            self.reclaim(n - self.pool.num_free)
        return self.pool.alloc(n)

    def _put_blocks(self, row: int, blocks: list[int]) -> None:
        if not blocks:
            return
        have = self._blocks[row]
        end = len(have) + len(blocks)
        if end > self.tables.shape[1]:
            self._grow_tables(cols=max(end, self.tables.shape[1] * 2))
        self.tables[row, len(have): end] = torch.tensor(blocks, dtype=torch.long)
        have.extend(blocks)

    def _grow_tables(self, rows: int | None = None, cols: int | None = None) -> None:
        r, c = self.tables.shape
        rows, cols = rows or r, cols or c
        grown = self.tables.new_zeros(rows, cols)
        grown[:r, :c] = self.tables
        self.tables = grown
        self._free_slots = list(range(rows - 1, r - 1, -1)) + self._free_slots if rows > r else self._free_slots
