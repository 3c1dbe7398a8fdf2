"""KV of aborted requests, kept so that the request resuming them skips its prefill.

A narrower SGLang radix cache: an aborted request comes back with exactly its tokens so far, so entries are whole
aborted sequences keyed by their token ids, holding the pool blocks of their cached positions; a hit hands them to
the resuming row without a copy. Entries are namespaced by `extra_key`, flushed by a weight update unless it says
`flush_cache: false`, record the version of their oldest position (`cache_stale_hits`), and are evicted least
recently stored first when the pool runs short.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable


@dataclass
class CachedKV:
    blocks: list[int]  # pool blocks, in position order
    cached: int  # positions with KV (the first `cached` tokens of the key)
    version: str | None = None  # the weight version that computed its oldest position


class PrefixCache:
    """Entries are evicted least-recently-stored first past `max_tokens` positions (counted in whole
    blocks of `block_size`); 0 disables it. `release(blocks)` gives evicted entries' blocks back."""

    def __init__(self, max_tokens: int, block_size: int, release: Callable[[list[int]], None]):
        self.max_tokens = max(0, int(max_tokens))
        self.block_size = block_size
        self.release = release
        self._entries: OrderedDict[tuple, CachedKV] = OrderedDict()  # (extra_key, token ids) -> KV
        self.tokens = 0  # positions held, in whole blocks

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _size(self, kv: CachedKV) -> int:
        return len(kv.blocks) * self.block_size

    def put(self, extra_key: str | None, tokens: list[int], kv: CachedKV) -> bool:
        """Take ownership of `kv`, the KV of `tokens[:kv.cached]` in namespace `extra_key`; its blocks are released
        at once if it cannot be kept (disabled, nothing cached, larger than the whole cache). True if kept."""
        size = self._size(kv)
        if not self.enabled or kv.cached <= 0 or size > self.max_tokens or kv.cached >= len(tokens):
            self.release(kv.blocks)
            return False
        if kv.cached > len(kv.blocks) * self.block_size:
            raise ValueError(f"prefix cache: {kv.cached} cached positions in {len(kv.blocks)} blocks of {self.block_size}")
        key = (extra_key, tuple(tokens))
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        self._entries[key] = kv
        self.tokens += size
        while self.tokens > self.max_tokens:
            self._drop(self._entries.popitem(last=False)[1])
        return True

    def take(self, extra_key: str | None, tokens: list[int]) -> CachedKV | None:
        """The entry for exactly `tokens` in namespace `extra_key`, removed from the cache (its blocks now belong to
        the caller)."""
        if not self._entries:
            return None
        kv = self._entries.pop((extra_key, tuple(tokens)), None)
        if kv is not None:
            self.tokens -= self._size(kv)
        return kv

    def evict(self, blocks: int) -> int:
        """Release least recently stored entries until at least `blocks` blocks went back; returns how many."""
        freed = 0
        while freed < blocks and self._entries:
            kv = self._entries.popitem(last=False)[1]
            freed += len(kv.blocks)
            self._drop(kv)
        return freed

    def clear(self) -> int:
        n = len(self._entries)
        while self._entries:
            self._drop(self._entries.popitem(last=False)[1])
        return n

    def _drop(self, kv: CachedKV) -> None:
        self.tokens -= self._size(kv)
        self.release(kv.blocks)
