"""KV of aborted requests, kept so that the request resuming them skips its prefill.

SGLang keeps a finished or aborted request's KV in its radix cache, and a later
request whose `input_ids` start with the same tokens reuses it. What APRIL
needs of that is narrower: an aborted request comes back with `input_ids` =
exactly its tokens so far. So entries here are whole aborted sequences, keyed
by their token ids, holding the KV of every token but the last (the last one
was sampled and not yet fed). A hit joins the decode batch directly, with that
last token pending.

As in SGLang, the cache holds KV computed with the weights of the moment: a
weight update flushes it unless the update says `flush_cache: false` (reusing
KV computed by older weights is then the caller's choice; the tokens keep the
version that sampled them), and `POST /flush_cache` empties it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

RowKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys [H, L, D], values [H, L, D])


class PrefixCache:
    """Least-recently-stored entries are evicted past `max_tokens` cached positions; 0 disables it."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max(0, int(max_tokens))
        self._entries: OrderedDict[tuple[int, ...], RowKV] = OrderedDict()
        self.tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], kv: RowKV) -> None:
        """Store the KV of `tokens[:-1]` (each layer's keys/values hold len(tokens) - 1 positions)."""
        n = len(tokens) - 1
        if not self.enabled or n <= 0 or n > self.max_tokens:
            return
        if any(k.shape[-2] != n or v.shape[-2] != n for k, v in kv):
            raise ValueError(f"prefix cache: KV for {n} positions expected, got {[tuple(k.shape) for k, _ in kv]}")
        key = tuple(tokens)
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= n
        self._entries[key] = kv
        self.tokens += n
        while self.tokens > self.max_tokens:
            evicted_key, _ = self._entries.popitem(last=False)
            self.tokens -= len(evicted_key) - 1

    def take(self, tokens: list[int]) -> RowKV | None:
        """The entry for exactly `tokens`, removed from the cache (it joins a running row), or None."""
        if not self._entries:
            return None
        kv = self._entries.pop(tuple(tokens), None)
        if kv is not None:
            self.tokens -= len(tokens) - 1
        return kv

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for kv in self._entries.values() for k, v in kv)

    def clear(self) -> int:
        n = len(self._entries)
        self._entries.clear()
        self.tokens = 0
        return n
