"""A running decode batch over a transformers causal LM with a per-row KV cache.

Rows are left-padded into one `DynamicCache`; a boolean key-validity matrix
`valid[B, L]` and explicit per-row position ids make padding invisible to
attention (we pass our own 4-D boolean masks, which transformers uses as is).
Rows join (a batched prefill, then their cache is concatenated in) and leave
(rows are index-selected out, and all-padding leading columns trimmed) between
any two decode steps: continuous batching.

Invariant: every row has a `pending` token, sampled but not yet in the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_HEADROOM = 64  # extra positions allocated when a layer's buffer grows


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes into a preallocated buffer instead of concatenating every step."""

    _layer_type = None  # never register in transformers' layer-type mapping

    def __init__(self):
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._len = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
        need = self._len + key_states.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            b, h, _, d = key_states.shape
            cap = need + max(_HEADROOM, need // 2)
            k, v = key_states.new_empty(b, h, cap, d), value_states.new_empty(b, h, cap, d)
            if self._len:
                k[:, :, : self._len] = self._k[:, :, : self._len]
                v[:, :, : self._len] = self._v[:, :, : self._len]
            self._k, self._v = k, v
        self._k[:, :, self._len: need] = key_states
        self._v[:, :, self._len: need] = value_states
        self._len = need
        self.keys, self.values = self._k[:, :, :need], self._v[:, :, :need]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._len:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, : self._len], self._v[:, :, : self._len]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the engine never crops its KV cache")


def _new_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [_GrowingLayer() for _ in range(len(cache.layers) or config.num_hidden_layers)]
    return cache


def _cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache_from(tensors: list[tuple[torch.Tensor, torch.Tensor]], config) -> DynamicCache:
    cache = _new_cache(config)
    for i, (k, v) in enumerate(tensors):
        cache.update(k, v, i)
    return cache


class DecodeBatch:
    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.cache: DynamicCache | None = None
        self.valid: torch.Tensor | None = None  # [B, L] bool
        self.next_pos = torch.zeros(0, dtype=torch.long)  # position of the pending token
        self.pending = torch.zeros(0, dtype=torch.long)

    @property
    def size(self) -> int:
        return int(self.pending.shape[0])

    @property
    def width(self) -> int:
        return 0 if self.valid is None else int(self.valid.shape[1])

    def clear(self) -> None:
        self.cache = None
        self.valid = None
        self.next_pos = torch.zeros(0, dtype=torch.long)
        self.pending = torch.zeros(0, dtype=torch.long)

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
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        eye = torch.eye(width, dtype=torch.bool)
        # padding queries attend to themselves only, so no row is fully masked (no NaNs)
        mask = (causal.unsqueeze(0) & valid.unsqueeze(1)) | eye.unsqueeze(0)
        cache = _new_cache(self.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask.unsqueeze(1),
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :], out.past_key_values, valid

    def join(self, cache: DynamicCache, valid: torch.Tensor, next_pos: list[int], pending: list[int]) -> None:
        """Append prefilled rows (their cache holds everything but the pending token)."""
        new_next = torch.tensor(next_pos, dtype=torch.long)
        new_pending = torch.tensor(pending, dtype=torch.long)
        if self.cache is None or self.size == 0:
            self.cache, self.valid = cache, valid
            self.next_pos, self.pending = new_next, new_pending
            return
        width = max(self.width, valid.shape[1])

        def lpad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            extra = width - t.shape[-dim_from_end]
            if extra == 0:
                return t
            pad = [0, 0] * (dim_from_end - 1) + [extra, 0]
            return F.pad(t, pad)

        merged = []
        for (k0, v0), (k1, v1) in zip(_cache_tensors(self.cache), _cache_tensors(cache)):
            merged.append((torch.cat([lpad(k0, 2), lpad(k1, 2)]), torch.cat([lpad(v0, 2), lpad(v1, 2)])))
        self.cache = _cache_from(merged, self.config)
        self.valid = torch.cat([lpad(self.valid, 1), lpad(valid, 1)])
        self.next_pos = torch.cat([self.next_pos, new_next])
        self.pending = torch.cat([self.pending, new_pending])

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); trim leading columns that are padding in every kept row."""
        if not rows:
            self.clear()
            return
        if len(rows) == self.size and rows == list(range(self.size)):
            return
        idx = torch.tensor(rows, dtype=torch.long)
        valid = self.valid[idx]
        first = int(valid.any(dim=0).to(torch.int8).argmax())
        tensors = [(k[idx, :, first:], v[idx, :, first:]) for k, v in _cache_tensors(self.cache)]
        self.cache = _cache_from(tensors, self.config)
        self.valid = valid[:, first:]
        self.next_pos = self.next_pos[idx]
        self.pending = self.pending[idx]

    @torch.inference_mode()
    def step(self) -> torch.Tensor:
        """Feed every row's pending token; return next-token logits [B, V]."""
        valid = torch.cat([self.valid, torch.ones(self.size, 1, dtype=torch.bool)], dim=1)
        out = self.model(
            input_ids=self.pending.unsqueeze(1),
            attention_mask=valid[:, None, None, :],
            position_ids=self.next_pos.unsqueeze(1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.valid = valid
        self.next_pos = self.next_pos + 1
        return out.logits[:, -1, :]

    def set_pending(self, tokens: list[int]) -> None:
        self.pending = torch.tensor(tokens, dtype=torch.long)
