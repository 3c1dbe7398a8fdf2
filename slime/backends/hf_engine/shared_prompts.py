"""Requests with the same prompt share its KV, as with SGLang's radix cache: of a GRPO group's n samples only the
first admitted (the leader) prefills the prompt; the others (same prompt and `extra_key`) wait, then start on the
leader's KV of every prompt position but the last (`PagedBatch.share_prefix`). A leader gone early leaves its
followers to prefill for themselves. Off with the prefix cache (--disable-radix-cache).
"""

from __future__ import annotations

from slime.backends.hf_engine.request import Request


class SharedPrompts:
    def __init__(self, batch, stats):
        self.batch = batch
        self.stats = stats
        self._leaders: dict[tuple, Request] = {}  # (extra_key, prompt) -> the running request prefilling it

    @staticmethod
    def _key(r: Request) -> tuple:
        return r.extra_key, tuple(r.input_ids)

    def admit(self, r: Request) -> None:
        """`r` just got an empty row: it leads its prompt, or follows the running request that does."""
        if r.output_ids or len(r.input_ids) < 2:
            return
        lead = self._leaders.get(self._key(r))
        if lead is not None and lead.row is not None:
            r.leader = lead
        else:
            self._leaders[self._key(r)] = r

    def ready(self, r: Request) -> bool:
        """Whether the follower `r` can be stepped: True once it starts on its leader's KV (or prefills itself, its
        leader gone), False while the leader is still prefilling."""
        lead, n = r.leader, len(r.input_ids) - 1
        if lead.row is not None and self.batch.cached(lead.row) < n:
            return False
        r.leader = None
        if lead.row is not None:
            self.batch.share_prefix(r.row, lead.row, n)
            r.cached_tokens = n
            r.kv_version = lead.kv_version  # the weights that computed its oldest position
            self.stats.shared_prompts += 1
            self.stats.shared_prompt_tokens += n
        return True

    def leave(self, r: Request) -> None:
        """`r` leaves the batch: it leads no more (its followers prefill for themselves) and follows no one."""
        if r.leader is None and self._leaders.get(self._key(r)) is r:
            del self._leaders[self._key(r)]
        r.leader = None

    def clear(self) -> None:
        """Every row dropped (a retraction, a failed step): no request leads or follows."""
        self._leaders.clear()
