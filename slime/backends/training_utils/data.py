"""Samples → tensors for the trainer: exclude FAILED samples, split a rollout
into optimizer steps and data-parallel shards, pack micro-batches (fixed size
or by token budget) and collate them into right-padded tensors.

Everything here is deterministic and independent of the rank, so every rank
computes the same plan and only keeps its own part.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class TrainItem:
    """One sample as tensors, with its position in the rollout (`pos`)."""

    pos: int  # index into the flattened (non-failed) rollout
    tokens: Tensor  # [L] prompt + response ids
    prompt_len: int
    loss_mask: Tensor  # [R] float
    rollout_log_probs: Tensor  # [R] behaviour log-probs from the engine
    reward: float

    @property
    def response_len(self) -> int:
        return int(self.tokens.numel()) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())


def scalar_reward(sample: Sample, reward_key: str | None = None) -> float:
    r = sample.reward
    if isinstance(r, dict):
        if reward_key is None or reward_key not in r:
            raise ValueError(
                f"sample {sample.index}: reward is a dict {sorted(r)} but --reward-key "
                f"({reward_key!r}) does not name one of its fields"
            )
        r = r[reward_key]
    if r is None:
        raise ValueError(f"sample {sample.index} (group {sample.group_index}) has no reward; the rollout must set it")
    return float(r)


def flatten_groups(groups: list[list[Sample]], reward_key: str | None = None) -> tuple[list[list[TrainItem]], int]:
    """Drop FAILED samples and turn the rest into TrainItems, keeping the
    group structure (for group-relative advantages). Returns (groups of items,
    number of failed samples excluded). Groups left empty are dropped."""
    out: list[list[TrainItem]] = []
    failed = 0
    pos = 0
    for gi, group in enumerate(groups):
        items = []
        for s in group:
            if s.status == Status.FAILED:
                failed += 1
                continue
            s.check()
            if s.response_length == 0:
                raise ValueError(f"sample {s.index} (group {gi}) has an empty response; it cannot be trained on")
            if s.prompt_length < 1:
                raise ValueError(f"sample {s.index} (group {gi}) has no prompt token; need at least one (BOS)")
            items.append(
                TrainItem(
                    pos=pos,
                    tokens=torch.tensor(s.tokens, dtype=torch.long),
                    prompt_len=s.prompt_length,
                    loss_mask=torch.tensor(s.loss_mask, dtype=torch.float32),
                    rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                    reward=scalar_reward(s, reward_key),
                )
            )
            pos += 1
        if items:
            out.append(items)
    return out, failed


def split_steps(n: int, global_batch_size: int) -> list[range]:
    """Positions [0, n) cut into optimizer steps of `global_batch_size`
    samples (the last one smaller when n is not a multiple)."""
    if global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {global_batch_size}")
    if n % global_batch_size:
        logger.warning("%d samples is not a multiple of --global-batch-size=%d: the last optimizer step is smaller",
                       n, global_batch_size)
    return [range(i, min(i + global_batch_size, n)) for i in range(0, n, global_batch_size)]


def shard(positions: list[int] | range, rank: int, world_size: int) -> list[int]:
    """This rank's data-parallel share (strided, so lengths are spread evenly)."""
    return list(positions)[rank::world_size]


def micro_batches(
    items: list[TrainItem],
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
) -> list[list[TrainItem]]:
    """Fixed-size micro-batches, or (when `max_tokens` is set) first-fit
    packing by token count so that each micro-batch holds at most
    `max_tokens` tokens (a longer sample gets a micro-batch of its own)."""
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
        bins: list[list[TrainItem]] = []
        loads: list[int] = []
        for it in sorted(items, key=lambda x: -x.num_tokens):
            for b, load in enumerate(loads):
                if load + it.num_tokens <= max_tokens:
                    bins[b].append(it)
                    loads[b] += it.num_tokens
                    break
            else:
                if it.num_tokens > max_tokens:
                    logger.warning("sample at position %d has %d tokens > --max-tokens-per-gpu=%d: own micro-batch",
                                   it.pos, it.num_tokens, max_tokens)
                bins.append([it])
                loads.append(it.num_tokens)
        return bins
    mbs = micro_batch_size or 1
    if mbs < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {mbs}")
    return [items[i : i + mbs] for i in range(0, len(items), mbs)]


def dummy_item(pad_id: int) -> TrainItem:
    """A 2-token, fully masked item: lets a rank with no data still run the
    forward/backward collectives that FSDP needs on every rank."""
    return TrainItem(
        pos=-1,
        tokens=torch.tensor([pad_id, pad_id], dtype=torch.long),
        prompt_len=1,
        loss_mask=torch.zeros(1),
        rollout_log_probs=torch.zeros(1),
        reward=0.0,
    )


@dataclass
class Batch:
    input_ids: Tensor  # [B, Lmax] right-padded
    attention_mask: Tensor  # [B, Lmax]
    items: list[TrainItem]


def collate(items: list[TrainItem], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    if not items:
        raise ValueError("collate: empty micro-batch")
    L = max(it.num_tokens for it in items)
    ids = torch.full((len(items), L), pad_id, dtype=torch.long)
    att = torch.zeros((len(items), L), dtype=torch.long)
    for i, it in enumerate(items):
        ids[i, : it.num_tokens] = it.tokens
        att[i, : it.num_tokens] = 1
    return Batch(ids.to(device), att.to(device), items)


def response_slices(logits: Tensor, batch: Batch) -> list[tuple[Tensor, Tensor]]:
    """Per item: (logits that predict the response tokens [R, V], the response tokens [R])."""
    out = []
    for i, it in enumerate(batch.items):
        p, L = it.prompt_len, it.num_tokens
        out.append((logits[i, p - 1 : L - 1], batch.input_ids[i, p:L]))
    return out


def num_steps_for(n_samples: int, global_batch_size: int) -> int:
    return math.ceil(n_samples / global_batch_size) if n_samples else 0
