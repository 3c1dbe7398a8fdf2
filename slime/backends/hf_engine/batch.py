"""A running decode batch over a transformers causal LM, its per-row KV cache in preallocated buffers.

Layout: per layer, K and V buffers `[R, H, W, D]` (R row slots, W columns). The B active rows are
slots `[0, B)`. Row i holds its cached tokens right-aligned at a global write column `hi`, in columns
`[hi - len_i, hi)`; the boolean `valid[R, W]` marks them, so the padding on their left is invisible to
attention (we pass our own 4-D boolean masks and explicit position ids, which transformers uses as is).
`lo` is the first column valid in any active row. A decode step writes every row's pending token at
column `hi` and attends over the views `[:B, :, lo:hi + 1]` (no copy), then `hi += 1`.

Continuous batching, between any two decode steps, copies only the rows that join or leave:
- join: new rows are prefilled together (a separate left-padded cache), then each row's block is
  copied into slots `B..` at columns `[hi - len, hi)`. A join longer than `hi` first shifts the batch
  right (one copy of the live window, leaving generous left room so this stays rare).
- remove: swap-remove (the last surviving rows move into the holes); the caller reorders its rows by
  the returned order.
- when `hi` reaches W, the live window `[lo, hi)` moves back left (one copy); R and W grow (by at
  least 1.5x, one copy) when short. An empty batch keeps its buffers for the next rows.

Invariant: every row has a `pending` token, sampled but not yet in the cache.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_ROOM = 64  # least spare columns kept left of `hi` (for longer joins) and right of it (for decode steps)


class _PrefillLayer(DynamicLayer):
    """Keeps a prefill's keys/values as computed (a prefill cache is written once; no copy)."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.is_initialized:
            raise RuntimeError("a prefill cache is written once")
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the engine never crops its KV cache")


class _BatchLayer(DynamicLayer):
    """Layer `idx` of a DecodeBatch's buffers: a decode step's K/V go to column `hi` of rows [0, B)."""

    _layer_type = None

    def __init__(self, batch: "DecodeBatch", idx: int):
        super().__init__()
        self.batch, self.idx = batch, idx
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b = self.batch
        n, lo, hi = b.size, b.lo, b.hi
        if key_states.shape[0] != n or key_states.shape[-2] != 1:
            raise RuntimeError(f"a decode step feeds one token per row, got {tuple(key_states.shape)} for {n} rows")
        k, v = b.k[self.idx], b.v[self.idx]
        k[:n, :, hi: hi + 1] = key_states
        v[:n, :, hi: hi + 1] = value_states
        self.keys, self.values = k[:n, :, lo: hi + 1], v[:n, :, lo: hi + 1]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.batch.hi - self.batch.lo

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the engine never crops its KV cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("rows leave through DecodeBatch.remove")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("rows leave through DecodeBatch.remove")


def _cache_with(config, layers: list[DynamicLayer]) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = layers
    return cache


class DecodeBatch:
    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.num_layers = len(DynamicCache(config=self.config).layers) or self.config.num_hidden_layers
        self.k: list[torch.Tensor] = []  # per layer [R, H, W, D]; allocated by the first join
        self.v: list[torch.Tensor] = []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)  # [R, W]
        self.lo = self.hi = 0
        self.cache: DynamicCache | None = None  # the _BatchLayers over the buffers
        self.next_pos = torch.zeros(0, dtype=torch.long)  # position of the pending token
        self.pending = torch.zeros(0, dtype=torch.long)

    @property
    def size(self) -> int:
        return int(self.pending.shape[0])

    @property
    def width(self) -> int:
        """Columns of the live window: the longest active row's cached tokens."""
        return self.hi - self.lo if self.size else 0

    def clear(self) -> None:
        """Drop every row; the buffers are kept for the next rows."""
        self.lo = self.hi
        self.next_pos = torch.zeros(0, dtype=torch.long)
        self.pending = torch.zeros(0, dtype=torch.long)

    def kv_bytes(self) -> int:
        """Bytes held by the KV buffers."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v) + self.valid.numel()

    def free_kv(self) -> int:
        """Drop every row and free the KV buffers (the next join allocates new ones); returns the bytes freed."""
        freed = self.kv_bytes()
        self.clear()
        self.k, self.v = [], []
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.lo = self.hi = 0
        return freed

    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]]) -> tuple[torch.Tensor, DynamicCache, torch.Tensor]:
        """Run `seqs` (left-padded together); return (last-position logits [n, V], cache, valid [n, L])."""
        n, width = len(seqs), max(len(s) for s in seqs)
        ids = torch.zeros(n, width, dtype=torch.long)
        valid = torch.zeros(n, width, dtype=torch.bool)
        pos = torch.zeros(n, width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            valid[i, width - len(s):] = True
            pos[i, width - len(s):] = torch.arange(len(s))
        if all(len(s) == width for s in seqs):
            mask = None  # no padding: transformers' own causal attention (SDPA's is_causal path, no mask tensor)
        else:
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            eye = torch.eye(width, dtype=torch.bool)
            # padding queries attend to themselves only, so no row is fully masked (no NaNs)
            mask = ((causal.unsqueeze(0) & valid.unsqueeze(1)) | eye.unsqueeze(0)).unsqueeze(1)
        cache = _cache_with(self.config, [_PrefillLayer() for _ in range(self.num_layers)])
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :], cache, valid

    def _reserve(self, rows: int, need: int, like: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Ensure `rows` row slots, `hi >= need` (room for a joining row of `need` tokens) and `hi < W`
        (a column for the next decode step); else re-lay the live window out, growing R or W if short."""
        b, (r, w) = self.size, self.valid.shape
        if b and rows <= r and need <= self.hi < w:
            return
        span = self.hi - self.lo if b else 0
        x = max(span, need)
        left, right = max(_ROOM, x // 4), max(_ROOM, x // 2)
        hi = x + left
        r2 = r if rows <= r else max(rows, r * 3 // 2, 8)
        w2 = w if w >= hi + right else max(w * 3 // 2, hi + 2 * right)
        if not b and (r2, w2) == (r, w):  # empty batch: just move the write column, stale slots are cleared on join
            self.lo = self.hi = hi
            return
        # zeros, not empty: masked columns still go through attention's matmuls, and 0 x NaN garbage is NaN
        shapes = [(k.shape[1], k.shape[3], k.dtype, k.device) for k, _ in (like or zip(self.k, self.v))]
        ks = [torch.zeros(r2, h, w2, d, dtype=dt, device=dev) for h, d, dt, dev in shapes]
        vs = [torch.zeros(r2, h, w2, d, dtype=dt, device=dev) for h, d, dt, dev in shapes]
        valid = torch.zeros(r2, w2, dtype=torch.bool, device=self.valid.device)
        if b:
            for new, old in zip(ks + vs, self.k + self.v):
                new[:b, :, hi - span: hi] = old[:b, :, self.lo: self.hi]
            valid[:b, hi - span: hi] = self.valid[:b, self.lo: self.hi]
        self.k, self.v, self.valid = ks, vs, valid
        self.lo, self.hi = hi - span, hi
        if self.cache is None:
            self.cache = _cache_with(self.config, [_BatchLayer(self, i) for i in range(len(ks))])

    def join(self, cache: DynamicCache, valid: torch.Tensor, rows: list[int], next_pos: list[int], pending: list[int]) -> None:
        """Add rows `rows` of a prefill (`cache`, `valid` from `prefill`; they hold everything but the
        pending token) as the batch's last rows. Copies only those rows."""
        self._place([(layer.keys, layer.values) for layer in cache.layers], valid, rows, next_pos, pending)

    def row_kv(self, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of row `row`'s last `n` cached positions, per layer ([H, n, D] keys and values)."""
        hi = self.hi
        return [(k[row, :, hi - n: hi].clone(), v[row, :, hi - n: hi].clone()) for k, v in zip(self.k, self.v)]

    def join_kv(self, kv: list[tuple[torch.Tensor, torch.Tensor]], next_pos: int, pending: int) -> None:
        """Add one row from saved KV (`row_kv` of an earlier row: positions 0..n-1) with `pending` next."""
        valid = torch.ones(1, int(kv[0][0].shape[-2]), dtype=torch.bool)
        self._place([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv], valid, [0], [next_pos], [pending])

    @torch.inference_mode()
    def _place(self, layers: list[tuple[torch.Tensor, torch.Tensor]], valid: torch.Tensor, rows: list[int],
               next_pos: list[int], pending: list[int]) -> None:
        """Copy rows `rows` of left-padded per-layer KV ([n, H, L, D], `valid` [n, L]) into slots `B..`."""
        if not rows:
            return
        b, n, width = self.size, len(rows), valid.shape[1]
        idx = torch.tensor(rows, dtype=torch.long)
        new_valid = valid[idx]
        need = int(new_valid.sum(1).max())
        self._reserve(b + n, need, like=layers)
        hi, slots = self.hi, slice(b, b + n)
        self.lo = min(self.lo, hi - need) if b else hi - need
        self.valid[slots] = False  # the slots may hold rows that left
        self.valid[slots, hi - need: hi] = new_valid[:, width - need:]
        every = rows == list(range(valid.shape[0]))
        for i, (k, v) in enumerate(layers):
            k, v = k[:, :, width - need:], v[:, :, width - need:]
            if not every:
                k, v = k[idx], v[idx]
            self.k[i][slots, :, hi - need: hi] = k
            self.v[i][slots, :, hi - need: hi] = v
        self.next_pos = torch.cat([self.next_pos, torch.tensor(next_pos, dtype=torch.long)])
        self.pending = torch.cat([self.pending, torch.tensor(pending, dtype=torch.long)])

    @torch.inference_mode()
    def remove(self, rows: list[int]) -> list[int]:
        """Drop the rows `rows`: the last surviving rows move into their slots (only they are copied).
        Returns the new order: for each remaining row, its index before the removal."""
        b, gone = self.size, set(rows)
        n = b - len(gone)
        if n == 0:
            self.clear()
            return []
        order = list(range(n))
        holes = [i for i in sorted(gone) if i < n]
        movers = [i for i in range(n, b) if i not in gone]
        lo, hi = self.lo, self.hi
        for h, m in zip(holes, movers):
            order[h] = m
            for buf in self.k + self.v:  # one slice copy per row (an indexed copy goes through a temporary)
                buf[h, :, lo:hi].copy_(buf[m, :, lo:hi])
            self.valid[h] = self.valid[m]
        idx = torch.tensor(order)
        self.next_pos, self.pending = self.next_pos[idx], self.pending[idx]
        # the leading columns may now be padding in every row: narrow the window attention runs over
        # (a uint8 max over rows is ~10x faster than a bool any over rows on CPU)
        self.lo += int(self.valid[:n, lo:hi].view(torch.uint8).amax(0).argmax())
        return order

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feed every row's pending token; return next-token logits [B, V]."""
        b = self.size
        self._reserve(b, 0)
        self.valid[:b, self.hi] = True
        out = self.model(
            input_ids=self.pending.unsqueeze(1),
            attention_mask=self.valid[:b, self.lo: self.hi + 1][:, None, None, :],
            position_ids=self.next_pos.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.hi += 1
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def set_pending(self, tokens: list[int]) -> None:
        self.pending = torch.tensor(tokens, dtype=torch.long)
