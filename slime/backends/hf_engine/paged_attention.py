"""Attention for one packed engine step over the paged KV pool (a transformers attention function, ATTN_NAME).

Per layer, the step's new keys/values are written into the pool at the `StepPlan`'s slots, then each bucket of
segments of similar length attends its rows' gathered, padded and causally masked keys (CPU decode buckets attend
in the pool: cpu_decode), a KV head's query heads stacked so nothing is repeated. Every shape and branch comes from
host integers in the plan: nothing reads a device tensor back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING, decode_bucket_ranges
from slime.backends.hf_engine.device import host_to_device
from slime.backends.hf_engine.kv_pool import KVPool

ATTN_NAME = "slime_paged"


@dataclass
class Bucket:
    """Segments attended together: `b` rows, `q` query cells each, `m` blocks of keys each; their cells
    are the packed tokens start .. start + b * q - 1, row by row."""

    segments: list[int]  # indices into the planned segments, in packing order
    q: int
    m: int
    blocks: torch.Tensor  # [b * m] block ids (rows padded with whatever their table holds; masked)
    limit: torch.Tensor  # [b, q] last key position each cell may attend (its own position)
    keys: int | None = None  # decode buckets whose rows all attend this many keys need no mask
    start: int = 0
    p0: int = 0  # first query position of the bucket's first segment (a prefill bucket's: of all of them)
    # prefill chunks of different lengths padded to the longest, `q` (merge_prefill): (padded cell -> packed cell of
    # the bucket, [b * q]: a padding cell repeats its chunk's last token; packed cell -> padded cell, [cells])
    pad: tuple[torch.Tensor, torch.Tensor] | None = None
    cells: int = 0  # packed tokens of the bucket (b * q unless padded)
    _masks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cells = self.cells or self.b * self.q

    @property
    def b(self) -> int:
        return len(self.segments)

    def mask(self, groups: int, block_size: int) -> torch.Tensor:
        """[1, b, q * groups, m * block_size] boolean (True: attend), built once per step on `limit`'s device;
        a cell's G query heads are rows q * G .. q * G + G - 1."""
        m = self._masks.get(groups)
        if m is None:
            pos = torch.arange(self.m * block_size, device=self.limit.device)
            m = pos.view(1, 1, -1) <= self.limit.unsqueeze(-1)  # [b, q, L]
            if groups > 1:
                m = m.repeat_interleave(groups, dim=1)
            m = self._masks[groups] = m.unsqueeze(0)
        return m


PREFILL_ATTENTION = ("split", "masked")


@dataclass
class StepPlan:
    pool: KVPool
    slots: torch.Tensor  # [N] pool slot (block * block_size + offset) of each packed token
    buckets: list[Bucket]
    kernel: str = "sdpa"  # sdpa: torch's scaled_dot_product_attention; eager: matmul, softmax, matmul
    prefill: str = "split"  # a prefill chunk with a prefix: "split" (CPU) or "masked" (see the module's doc)
    decode_kernel: object = None  # cpu_decode.DecodeKernel: decode buckets attended in the pool, nothing gathered


def _eager(q, k, v, mask, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


# torch's CPU flash-attention kernel also returns each query's log-sum-exp (public SDPA does not), so a chunk's
# prefix (no mask) and causal part merge exactly; one mask over chunk x context costs ~35% more on this CPU.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_lse(q, k, v, causal: bool, scale, kernel: str):
    """Attention and per-query log-sum-exp of the scaled scores ([..., Lq, D], [..., Lq])."""
    if kernel == "eager" or _FLASH_CPU is None:
        scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            n = scores.shape[-1]
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        lse = scores.logsumexp(dim=-1)
        return torch.matmul((scores - lse.unsqueeze(-1)).exp(), v), lse
    out = _FLASH_CPU(q, k, v, is_causal=causal, scale=scale)
    return out[0], out[1]


def _prefill(q, k_new, v_new, prefix, g: int, scale, kernel: str):
    """A bucket of prefill chunks of one shape: q [b, nq, H, D] (their queries), k_new/v_new
    [b, Hkv, nq, D] (their own keys), prefix None (chunks starting at position 0) or (k, v)
    [Hkv, b, p0, D] (every earlier position). Returns [b, nq, H, D]."""
    b, nq, h, d = q.shape
    hkv = k_new.shape[1]
    qh = q.transpose(1, 2)  # [b, H, nq, D]
    kh, vh = k_new.repeat_interleave(g, dim=1), v_new.repeat_interleave(g, dim=1)
    if prefix is None:
        if kernel == "eager":
            o = _attend_lse(qh, kh, vh, True, scale, kernel)[0]
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        return o.transpose(1, 2)
    o2, l2 = _attend_lse(qh, kh, vh, True, scale, kernel)
    # the prefix: every query sees every earlier key; a KV head's G query heads stacked as G x nq queries
    qs = q.view(b, nq, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv, b, g * nq, d)
    o1, l1 = _attend_lse(qs, prefix[0], prefix[1], False, scale, kernel)
    o1 = o1.view(hkv, b, g, nq, d).transpose(0, 1).reshape(b, h, nq, d)
    l1 = l1.view(hkv, b, g, nq).transpose(0, 1).reshape(b, h, nq)
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp().unsqueeze(-1), (l2 - m).exp().unsqueeze(-1)
    return ((o1 * w1 + o2 * w2) / (w1 + w2)).transpose(1, 2)


def paged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                    scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """query [1, H, N, D], key/value [1, Hkv, N, D] for the packed tokens; returns [1, N, H, D]."""
    plan: StepPlan | None = kwargs.pop("paged_step", None)
    if plan is None:  # the model called outside an engine step (e.g. a prompt-log-prob pass): plain SDPA
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("the embedded engine's paged attention has no sliding-window layers")
    layer = module.layer_idx
    pool = plan.pool
    pool.write(layer, plan.slots, key[0], value[0])
    _, h, _, d = query.shape
    hkv = key.shape[1]
    g = h // hkv
    bs = pool.block_size
    q_all = query[0].transpose(0, 1)  # [N, H, D]
    outs = []
    for bk in plan.buckets:
        b, nq, end = bk.b, bk.q, bk.start + bk.cells
        q = q_all[bk.start: end]
        if bk.pad is not None:  # chunks of different lengths, padded to the longest (its output cells dropped below)
            q = q.index_select(0, bk.pad[0])
        q = q.view(b, nq, h, d)
        if nq > 1 and bk.p0 and plan.prefill == "masked":  # chunks with a prefix, as one masked bucket
            k, v = pool.gather(layer, bk.blocks, b)  # every position up to the chunks' last (written above)
            qs = q.view(b, nq, hkv, g, d).permute(2, 0, 1, 3, 4).reshape(hkv, b, nq * g, d)
            mask = bk.mask(g, bs)
            if plan.kernel == "eager":
                o = _eager(qs, k, v, mask, scaling)
            else:
                o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scaling)
            outs.append(_unpad(o.view(hkv, b, nq, g, d).permute(1, 2, 0, 3, 4).reshape(b * nq, h, d), bk))
            continue
        if nq > 1:  # prefill chunks of one shape: their own keys causally, plus the keys before them
            k_new, v_new = key[0, :, bk.start: end], value[0, :, bk.start: end]
            if bk.pad is not None:  # a padding cell's key is its chunk's last: causal attention never reaches it
                k_new, v_new = k_new.index_select(1, bk.pad[0]), v_new.index_select(1, bk.pad[0])
            k_new = k_new.reshape(hkv, b, nq, d).transpose(0, 1)
            v_new = v_new.reshape(hkv, b, nq, d).transpose(0, 1)
            prefix = None
            if bk.p0:
                k, v = pool.gather(layer, bk.blocks, b)
                prefix = (k[:, :, :bk.p0], v[:, :, :bk.p0])
            outs.append(_unpad(_prefill(q, k_new, v_new, prefix, g, scaling, plan.kernel).reshape(b * nq, h, d), bk))
            continue
        if plan.decode_kernel is not None:
            o = plan.decode_kernel(q.view(b, h, d), pool.layer_tensor(layer), bk.blocks, bk.limit,
                                   d ** -0.5 if scaling is None else scaling)
            if o is not None:
                outs.append(o)
                continue
        k, v = pool.gather(layer, bk.blocks, b)
        q = q.view(b, hkv, g, d).transpose(0, 1)  # [Hkv, b, G, D]: a KV head's G query heads as G queries
        if bk.keys is not None:  # no padding: attend exactly the rows' keys, no mask (SDPA's fast path)
            k, v, mask = k[:, :, : bk.keys], v[:, :, : bk.keys], None
        else:
            mask = bk.mask(g, bs)
        if plan.kernel == "eager":
            o = _eager(q, k, v, mask, scaling)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        outs.append(o.transpose(0, 1).reshape(b, h, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(0), None


def _unpad(o: torch.Tensor, bk: Bucket) -> torch.Tensor:
    """A padded bucket's output cells back in packing order (padding dropped); others as they are."""
    return o if bk.pad is None else o.index_select(0, bk.pad[1])


def step_mask(device: torch.device | str) -> torch.Tensor:
    """What an engine step passes as `attention_mask`: a 4-D mask is used as given (transformers builds none),
    and this function ignores it. Outside steps the model builds SDPA's masks (registered below) as usual."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def register() -> None:
    """Make ATTN_NAME known to transformers (idempotent): this function, and SDPA's mask builder for
    forwards outside engine steps."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def plan_buckets(segments: list[tuple[int, int, int]], tables: torch.Tensor, block_size: int,
                 min_saving: int = BUCKET_MIN_SAVING, merge_prefill: bool = False) -> list[Bucket]:
    """Buckets for `segments` = (queries q, first position p0, table row), in packing order; `start` numbers the cells
    bucket after bucket. Decode segments are sorted longest first and split where `buckets.decode_bucket_ranges` says;
    prefill segments share a bucket with segments of their shape, or with `merge_prefill` (a GPU's masked prefill)
    any shape padded to the longest while the padded attention is at most twice the exact one plus PAD_SLACK_PAIRS."""
    buckets: list[Bucket] = []
    decode = sorted((i for i, s in enumerate(segments) if s[0] == 1), key=lambda i: -segments[i][1])
    blocks = [segments[i][1] // block_size + 1 for i in decode]
    for i, j in decode_bucket_ranges(blocks, block_size, min_saving):  # the rule lives in buckets.py
        buckets.append(_bucket(segments, decode[i:j], 1, blocks[i], tables))
    if merge_prefill:
        for fresh in (True, False):
            idx = sorted((i for i, s in enumerate(segments) if s[0] > 1 and (s[1] == 0) == fresh),
                         key=lambda i: (-segments[i][0], -segments[i][1]))
            for group in _padded_groups(segments, idx, fresh):
                buckets.append(_padded_bucket(segments, group, tables, block_size))
    else:
        prefill: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(segments):
            if s[0] > 1:
                prefill.setdefault((s[0], s[1]), []).append(i)
        for (q, p0), idx in prefill.items():
            buckets.append(_bucket(segments, idx, q, (p0 + q - 1) // block_size + 1, tables))
    start = 0
    for bk in buckets:
        bk.start = start
        start += bk.cells
    return buckets


PAD_SLACK_PAIRS = 1 << 20  # padded (query, key) pairs a merged prefill bucket may waste beyond its exact ones
MAX_PADDED_PAIRS = 1 << 26  # and at most this many in all (its mask: this x query heads per KV head, in bytes)


def _padded_groups(segments, idx: list[int], fresh: bool) -> list[list[int]]:
    """`idx` (longest chunks first) cut into groups whose padded attention stays within the bounds above."""
    groups: list[list[int]] = []
    cur: list[int] = []
    exact = q_max = k_max = 0
    for i in idx:
        q, p0 = segments[i][0], segments[i][1]
        keys = q if fresh else p0 + q
        e, qm, km = exact + q * keys, max(q_max, q), max(k_max, keys)
        padded = (len(cur) + 1) * qm * km
        if cur and (padded > 2 * e + PAD_SLACK_PAIRS or padded > MAX_PADDED_PAIRS):
            groups.append(cur)
            cur, e, qm, km = [], q * keys, q, keys
        cur.append(i)
        exact, q_max, k_max = e, qm, km
    if cur:
        groups.append(cur)
    return groups


def _padded_bucket(segments, idx: list[int], tables: torch.Tensor, block_size: int) -> Bucket:
    """Prefill chunks `idx` (all fresh, or all with a prefix) in one bucket, each padded to the longest with copies
    of its last token (which attend what that token attends; their outputs are dropped)."""
    qs = [segments[i][0] for i in idx]
    starts = [segments[i][1] for i in idx]
    q = max(qs)
    m = max((p0 + n - 1) // block_size + 1 for p0, n in zip(starts, qs))
    if all(n == q for n in qs):  # one length: nothing to pad (chunks after prefixes of any lengths are masked)
        bk = _bucket(segments, idx, q, m, tables)
        bk.p0 = min(starts)
        return bk
    gather, keep, at = [], [], 0
    for r, n in enumerate(qs):
        gather += [at + min(j, n - 1) for j in range(q)]
        keep += [r * q + j for j in range(n)]
        at += n
    rows = torch.tensor([segments[i][2] for i in idx], dtype=torch.long)
    blocks = tables.index_select(0, rows)[:, :m].reshape(-1)
    offs = torch.tensor([[min(j, n - 1) for j in range(q)] for n in qs], dtype=torch.long)
    limit = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + offs
    return Bucket(idx, q, m, blocks, limit, p0=min(starts), cells=at,
                  pad=(torch.tensor(gather, dtype=torch.long), torch.tensor(keep, dtype=torch.long)))


def _bucket(segments, idx: list[int], q: int, m: int, tables: torch.Tensor) -> Bucket:
    starts = [segments[i][1] for i in idx]
    if len(idx) == 1:
        blocks = tables[segments[idx[0]][2], :m]
    else:
        blocks = tables.index_select(0, torch.tensor([segments[i][2] for i in idx], dtype=torch.long))[:, :m].reshape(-1)
    limit = torch.tensor(starts, dtype=torch.long).unsqueeze(1) + torch.arange(q, dtype=torch.long)
    same = q == 1 and min(starts) == max(starts)
    return Bucket(idx, q, m, blocks, limit, keys=starts[0] + 1 if same else None, p0=starts[0])


def move_plan(buckets: list[Bucket], extra: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Put the buckets' block ids and limits, and the `extra` int64 host tensors, on `device` in ONE copy; returns
    `extra` there. On the CPU nothing moves."""
    if device.type == "cpu":
        return extra
    host = [*extra]
    for bk in buckets:
        host += [bk.blocks, bk.limit, *(bk.pad or ())]
    flat = host_to_device(torch.cat([t.reshape(-1) for t in host]), device)
    out, at = [], 0
    for t in host:
        out.append(flat[at: at + t.numel()].view(t.shape))
        at += t.numel()
    at = len(extra)
    for bk in buckets:
        bk.blocks, bk.limit = out[at], out[at + 1]
        at += 2
        if bk.pad is not None:
            bk.pad, at = (out[at], out[at + 1]), at + 2
    return out[: len(extra)]
