"""The engine's KV memory: fixed-size blocks in one pool per layer, handed out by a free list.

Layer l holds `[2, Hkv, num_blocks, block_size, D]` (keys, then values; head-major so a row's gather copies
contiguous runs). Block 0 is never handed out: tables pad with it and its zeros keep masked positions finite.
A block may have several holders (`share`) and is freed by the last. The pool grows by reallocation up to
`max_blocks`; layers are allocated on first write.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """The pool is at `max_blocks` and the free list cannot cover an allocation."""


class KVPool:
    def __init__(self, block_size: int, max_blocks: int, initial_blocks: int = 256):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_blocks < 2:
            raise ValueError(f"max_blocks must be >= 2 (block 0 is reserved), got {max_blocks}")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.initial_blocks = initial_blocks
        self._kv: dict[int, torch.Tensor] = {}
        self.generation = 0  # changes whenever a layer's tensor is (re)allocated or freed (CUDA graphs hold addresses)
        self._reset()

    def _reset(self, capacity: int | None = None) -> None:
        self.generation += 1
        self.capacity = min(max(2, capacity or self.initial_blocks), self.max_blocks)
        self._free: list[int] = list(range(self.capacity - 1, 0, -1))  # pop() hands out low ids first
        self._extra_holders: dict[int, int] = {}  # block -> holders beyond the first (shared blocks)

    # ---- blocks ------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can still be handed out (free now, or by growing)."""
        return len(self._free) + self.max_blocks - self.capacity

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n <= 0:
            return []
        if len(self._free) < n:
            self._grow(self.capacity + n - len(self._free))
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        """One holder gives `blocks` back; a block is free again when its last holder has."""
        if not self._extra_holders:
            self._free.extend(blocks)
            return
        for b in blocks:
            n = self._extra_holders.get(b)
            if n is None:
                self._free.append(b)
            elif n == 1:
                del self._extra_holders[b]
            else:
                self._extra_holders[b] = n - 1

    def share(self, blocks: list[int]) -> None:
        """One more holder of each of `blocks` (which it must never write: full blocks of a shared prefix)."""
        for b in blocks:
            self._extra_holders[b] = self._extra_holders.get(b, 0) + 1

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's keys and values of block `src` into block `dst`."""
        for t in self._kv.values():
            t[:, :, dst] = t[:, :, src]

    def _grow(self, need: int) -> None:
        if need > self.max_blocks:
            raise OutOfBlocks(f"KV pool: {need} blocks needed, at most {self.max_blocks} of {self.block_size} tokens")
        new = min(self.max_blocks, max(need, self.capacity * 3 // 2))
        device = None
        for layer, t in self._kv.items():
            grown = t.new_zeros(2, t.shape[1], new, *t.shape[3:])
            grown[:, :, : self.capacity] = t
            self._kv[layer] = grown
            device = t.device
        t = grown = None  # noqa: F841 - no reference to an old tensor survives the loop
        if device is not None and device.type == "cuda":
            # give the old, smaller tensors back to the device at once: the caching allocator would keep them,
            # and a pool grown a few times would hold several times its size
            torch.cuda.empty_cache()
        self._free.extend(range(new - 1, self.capacity - 1, -1))
        self._free.sort(reverse=True)
        self.capacity = new
        self.generation += 1

    # ---- tensors -----------------------------------------------------------------------
    def layer(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `idx`'s keys and values, [Hkv, num_blocks, block_size, D] each (views)."""
        kv = self._kv[idx]
        return kv[0], kv[1]

    def write(self, idx: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store `keys`/`values` ([Hkv, N, D]) at flat slots `slots` ([N], block * block_size + offset)."""
        kv = self._kv.get(idx)
        if kv is None:
            h, _, d = keys.shape
            kv = self._kv[idx] = keys.new_zeros(2, h, self.capacity, self.block_size, d)
            self.generation += 1
        flat = kv.view(2, kv.shape[1], -1, kv.shape[-1])
        flat[0].index_copy_(1, slots, keys)
        flat[1].index_copy_(1, slots, values)

    def layer_tensor(self, idx: int) -> torch.Tensor:
        """Layer `idx`'s whole tensor, [2, Hkv, num_blocks, block_size, D] (keys, then values)."""
        return self._kv[idx]

    def gather(self, idx: int, blocks: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `blocks` ([rows * m] ids, m per row), as [Hkv, rows, m * block_size, D] each
        (one copy of both)."""
        kv = self._kv[idx]
        g = kv.index_select(2, blocks)
        g = g.view(2, kv.shape[1], rows, -1, kv.shape[-1])
        return g[0], g[1]

    @property
    def layers_allocated(self) -> int:
        return len(self._kv)

    def nbytes(self) -> int:
        """Bytes held by the per-layer tensors (every block: a running row's, the prefix cache's, free ones)."""
        return sum(t.numel() * t.element_size() for t in self._kv.values())

    def release(self) -> int:
        """Free the storage (SGLang's kv_cache tag); every block must be back. Layers come back on first write at the
        capacity the pool had, so the next rollout does not grow it again. Returns the bytes freed."""
        if self.num_used:
            raise RuntimeError(f"KV pool: {self.num_used} blocks still held (a running row or the prefix cache)")
        freed = self.nbytes()
        self._kv.clear()
        self._reset(self.capacity)
        return freed
