"""Samples → tensors for the trainer: drop FAILED samples, split a rollout into optimizer steps, plan every
data-parallel rank's micro-batches and lay one out (right-padded, or packed). Deterministic and independent of the
rank: every rank computes the same plan and keeps its own part."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

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
    rollout_id: int | None = None  # upstream's `Sample.rollout_id`, set by a plugin

    @property
    def rollout(self) -> tuple:
        """Its rollout: items sharing one are one term of a sample-mean loss; without a `rollout_id`, its own."""
        return ("sample", self.pos) if self.rollout_id is None else ("rollout_id", self.rollout_id)

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
    """(groups of TrainItems, number of FAILED samples dropped); groups left empty are dropped. As upstream, a
    sample a plugin removed trains with a zero loss mask (its reward still counts in its group)."""
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
                    loss_mask=torch.tensor(s.trained_loss_mask, dtype=torch.float32),
                    rollout_log_probs=torch.tensor(s.rollout_log_probs, dtype=torch.float32),
                    reward=scalar_reward(s, reward_key),
                    rollout_id=s.rollout_id,
                )
            )
            pos += 1
        if items:
            out.append(items)
    return out, failed


def split_steps(rollouts: list, global_batch_size: int) -> list[list[int]]:
    """Positions (`rollouts[p]`: position p's rollout) cut into optimizer steps of `global_batch_size` rollouts, in
    order of first appearance, as upstream (the last step smaller when the count is not a multiple)."""
    if global_batch_size < 1:
        raise ValueError(f"--global-batch-size must be >= 1, got {global_batch_size}")
    members: dict[Any, list[int]] = {}
    for p, r in enumerate(rollouts):
        members.setdefault(r, []).append(p)
    units = list(members.values())
    if len(units) % global_batch_size:
        logger.warning("%d rollouts is not a multiple of --global-batch-size=%d: the last optimizer step is smaller",
                       len(units), global_batch_size)
    return [[p for unit in units[i : i + global_batch_size] for p in unit]
            for i in range(0, len(units), global_batch_size)]


def rollout_tokens(items: list[TrainItem]) -> Counter:
    """{rollout: its loss tokens among `items`} (`TrainItem.rollout`): a sample-mean loss's denominators."""
    out: Counter = Counter()
    for it in items:
        out[it.rollout] += float(it.loss_mask.sum())
    return out


def plan_micro_batches(items: list[TrainItem], dp_size: int, micro_batch_size: int,
                       max_tokens: int | None = None, balance: bool = False) -> list[list[list[TrainItem]]]:
    """Every data-parallel rank's micro-batches for `items` (index = DP rank). Fixed size (`max_tokens` None): a
    strided share per rank (`balance`: lightest rank first), cut into `micro_batch_size`. Token budget: lightest
    rank first, then first-fit bins of <= `max_tokens`, rebalanced to the count of the rank that needs most."""
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    if max_tokens is None:
        mbs = micro_batch_size or 1
        if mbs < 1:
            raise ValueError(f"--micro-batch-size must be >= 1, got {mbs}")
        parts = _lightest_first(items, dp_size) if balance else [items[r::dp_size] for r in range(dp_size)]
        return [[part[i : i + mbs] for i in range(0, len(part), mbs)] for part in parts]
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
    shares = _lightest_first(items, dp_size)
    packed = [_first_fit(share, max_tokens) for share in shares]
    n_bins = max(len(bins) for bins in packed)
    out = []
    for share, bins in zip(shares, packed):
        balanced = _lightest_first(share, n_bins)
        ok = all(len(b) <= 1 or sum(it.num_tokens for it in b) <= max_tokens for b in balanced)
        out.append([b for b in (balanced if ok else bins) if b])
    return out


def _by_length(items: list[TrainItem]) -> list[TrainItem]:
    return sorted(items, key=lambda it: (-it.num_tokens, it.pos))


def _lightest_first(items: list[TrainItem], n: int) -> list[list[TrainItem]]:
    """Longest first, each into the part with the fewest tokens (then fewest items) so far."""
    parts: list[list[TrainItem]] = [[] for _ in range(n)]
    loads = [0] * n
    for it in _by_length(items):
        k = min(range(n), key=lambda j: (loads[j], len(parts[j]), j))
        parts[k].append(it)
        loads[k] += it.num_tokens
    return parts


def _first_fit(items: list[TrainItem], max_tokens: int) -> list[list[TrainItem]]:
    bins: list[list[TrainItem]] = []
    loads: list[int] = []
    for it in _by_length(items):
        for b, load in enumerate(loads):
            if load + it.num_tokens <= max_tokens:
                bins[b].append(it)
                loads[b] += it.num_tokens
                break
        else:
            if it.num_tokens > max_tokens:
                logger.warning("sample at position %d has %d tokens > --max-tokens-per-gpu=%d: a micro-batch of its "
                               "own", it.pos, it.num_tokens, max_tokens)
            bins.append([it])
            loads.append(it.num_tokens)
    return bins


def dummy_item(pad_id: int) -> TrainItem:
    """A 2-token, fully masked item: a rank with no data still runs the forward/backward collectives."""
    return TrainItem(
        pos=-1,
        tokens=torch.tensor([pad_id, pad_id], dtype=torch.long),
        prompt_len=1,
        loss_mask=torch.zeros(1),
        rollout_log_probs=torch.zeros(1),
        reward=0.0,
    )


@dataclass
class MicroBatch:
    """One micro-batch as model inputs. Padded: `input_ids` [B, S], `attention_mask` [B, S]. Packed: `input_ids`
    [1, T] back to back, `cu_seqlens` [n + 1] segment bounds (also on the host). `rows`: the flat positions whose
    next token is a response token, `targets` those tokens, in item order."""

    items: list[TrainItem]
    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor | None
    cu_seqlens: Tensor | None
    max_seqlen: int
    rows: Tensor
    targets: Tensor
    cu_seqlens_host: Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def to_device(tensors: list[Tensor | None], device: torch.device | str) -> list[Tensor | None]:
    """Host tensors -> `device` in one copy per dtype; on a GPU from pinned memory, so the host never waits for
    the device (a copy from pageable memory first waits for all queued work)."""
    device = torch.device(device)
    if device.type == "cpu":
        return list(tensors)
    out: list[Tensor | None] = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            by_dtype.setdefault(t.dtype, []).append(i)
    pin = device.type == "cuda"
    for dtype, idx in by_dtype.items():
        flat = [tensors[i].reshape(-1) for i in idx]
        total = sum(f.numel() for f in flat)
        buf = torch.empty(total, dtype=dtype, pin_memory=pin)
        torch.cat(flat, out=buf)
        dev = buf.to(device, non_blocking=pin)
        for i, part in zip(idx, dev.split([f.numel() for f in flat])):
            out[i] = part.view(tensors[i].shape)
    return out


def build_micro_batch(items: list[TrainItem], pad_id: int, packed: bool, device: torch.device | str = "cpu",
                      multiple: int = 1) -> MicroBatch:
    """Laid out on the host, then on `device` in one copy per dtype (`to_device`)."""
    if not items:
        raise ValueError("build_micro_batch: empty micro-batch")
    lengths = [it.num_tokens for it in items]
    rows = []
    if packed:
        total = sum(lengths)
        extra = -total % multiple
        segs = lengths + ([extra] if extra else [])
        ids = torch.cat([it.tokens for it in items] + ([torch.full((extra,), pad_id, dtype=torch.long)] if extra else []))
        pos = torch.cat([torch.arange(n) for n in segs])
        starts = [0]
        for n in segs:
            starts.append(starts[-1] + n)
        cu = torch.tensor(starts, dtype=torch.int32)
        for it, off in zip(items, starts):
            rows.append(torch.arange(off + it.prompt_len - 1, off + it.num_tokens - 1))
        input_ids, position_ids, mask, max_len = ids[None], pos[None], None, max(segs)
    else:
        width = max(lengths)
        width += -width % multiple
        input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width), dtype=torch.long)
        for i, it in enumerate(items):
            input_ids[i, : it.num_tokens] = it.tokens
            mask[i, : it.num_tokens] = 1
            rows.append(torch.arange(i * width + it.prompt_len - 1, i * width + it.num_tokens - 1))
        position_ids = torch.arange(width)[None]
        cu, max_len = None, width
    targets = torch.cat([it.tokens[it.prompt_len :] for it in items])
    ids_d, pos_d, mask_d, cu_d, rows_d, tgt_d = to_device([input_ids, position_ids, mask, cu, torch.cat(rows), targets],
                                                          device)
    if not packed:
        pos_d = pos_d.expand(len(items), width)
    return MicroBatch(items, ids_d, pos_d, mask_d, cu_d, int(max_len), rows_d, tgt_d, cu_seqlens_host=cu)
