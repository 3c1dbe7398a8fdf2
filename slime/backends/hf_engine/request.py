"""A request in the embedded engine's scheduler (slime/backends/hf_engine/scheduler.py): its prompt, sampling
params, what it produced and where it runs; and what ends it, in SGLang's order (`finish_reason`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from slime.backends.hf_engine.logprobs import LogprobRecord
from slime.backends.hf_engine.sampling import SamplingParams


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    notify: Callable[["Request", bool], None] | None = None  # (request, finished)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict | None = None
    generator: torch.Generator | None = None
    created: float = field(default_factory=time.monotonic)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    enqueued: float = 0.0
    logprobs_extra: LogprobRecord | None = None  # prompt / top-k / chosen-id log-probs, when asked for
    # (first output index, weight version) each time the version that samples this request's tokens changes
    version_spans: list[tuple[int, str]] = field(default_factory=list)
    row: int | None = None  # its row in the batch while running
    extra_key: str | None = None  # SGLang's prefix-cache namespace (our client: the weight version it was sent at)
    kv_version: str | None = None  # while it has a row: the weight version that computed its oldest KV position
    retractions: int = 0  # times its KV was dropped and it was sent back to the queue (SGLang's num_retractions)
    # a running request with the same prompt (and extra_key) whose prefill this one waits for, to start on its KV
    leader: Request | None = None

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of input_ids + output_ids (without building the whole list)."""
        n = len(self.input_ids)
        if end <= n:
            return self.input_ids[start:end]
        if start >= n:
            return self.output_ids[start - n: end - n]
        return self.input_ids[start:] + self.output_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


def abort_reason(message: str = "Aborted", status_code: int | None = None) -> dict:
    """SGLang's FINISH_ABORT: an abort asked for (/abort_request, a pause) is "Aborted" with no status code."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


def eos_ids(model, tokenizer) -> set[int]:
    """The token ids that end a request: the model's generation config and config, and the tokenizer's."""
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def finish_reason(r: Request, token: int, eos: set[int], tokenizer) -> dict | None:
    """SGLang's order: the length limit, then stop tokens (EOS and stop_token_ids, both off with
    ignore_eos, as in SGLang), then stop strings anywhere in the output text (also inside a
    multi-character token; special tokens' text counts, as in SGLang's tail check), then stop regexes."""
    p = r.params
    if len(r.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": len(r.output_ids)}
    if not p.ignore_eos and (token in p.stop_token_ids or token in eos):
        return {"type": "stop", "matched": token}
    if p.stop or p.stop_regex:
        full = tokenizer.decode(r.output_ids, skip_special_tokens=False)
        shown = tokenizer.decode(r.output_ids, skip_special_tokens=True) if p.skip_special_tokens else full
        for s in p.stop:
            if s in full or s in shown:
                return {"type": "stop", "matched": s}
        for rx in p.stop_regex:
            if rx.search(full):
                return {"type": "stop", "matched": rx.pattern}
    return None
