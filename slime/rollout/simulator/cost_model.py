"""What an engine's work costs, in seconds: the rollout simulator's engine model (one engine = one TP group).

A decode step costs base + per row + per cached token + per gathered key position + per extra bucket, the host's
part max(issue, device) + tail (`host_fit.py`); then prefill ("mixed" or "batched"), HTTP, abort, weight update
and admission costs. Numbers come from `calibrate.py` or `gpu_presets.py`."""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass, field

import numpy as np

from slime.backends.hf_engine.buckets import BUCKET_MIN_SAVING, decode_shape, graph_blocks, graph_rows

DECODE_TERMS = ("decode_base_s", "decode_per_seq_s", "decode_per_token_s", "decode_per_padded_s", "decode_per_bucket_s")
PREFILL_TERMS = ("prefill_base_s", "prefill_per_token_s", "prefill_per_token2_s", "prefill_per_chunk_s")
HOST_TERMS = ("host_step_s", "host_per_row_s", "host_per_bucket_s")  # issuing a step (overlaps the device)
TAIL_TERMS = ("host_tail_s", "host_tail_per_row_s")  # after its tokens are back (overlaps nothing)
PREFILL_MODES = ("batched", "mixed")
TIME_FIELDS = DECODE_TERMS + PREFILL_TERMS + HOST_TERMS + TAIL_TERMS + ("finish_s", "abort_s", "request_latency_s", "client_per_request_s",
                                              "client_per_input_token_s", "client_per_token_s", "engine_per_request_s", "engine_per_input_token_s",
                                              "engine_per_output_token_s", "step_overhead_s", "weight_update_s")


@dataclass(frozen=True)
class EngineCostModel:
    decode_base_s: float
    decode_per_seq_s: float = 0.0
    decode_per_token_s: float = 0.0
    decode_per_padded_s: float = 0.0
    decode_per_bucket_s: float = 0.0  # per attention bucket beyond the first (paged engines)
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    prefill_per_token2_s: float = 0.0
    prefill_per_chunk_s: float = 0.0  # "mixed": per prompt chunk (one row's segment) in a step
    host_step_s: float = 0.0  # the host issuing a step: per step, per row (decoded or prefilled), per extra bucket
    host_per_row_s: float = 0.0
    host_per_bucket_s: float = 0.0
    host_tail_s: float = 0.0  # the host after a step's tokens are back: per step, per row
    host_tail_per_row_s: float = 0.0
    finish_s: float = 0.0
    abort_s: float = 0.01
    request_latency_s: float = 0.002
    client_per_request_s: float = 0.0  # the client's own work per request (sending it, reading its reply)
    client_per_input_token_s: float = 0.0  # the client's work per token of a request's input (building, sending it)
    client_per_token_s: float = 0.0  # the client's work per token of a reply (parsing, appending to the sample)
    # the engine's own HTTP work, which stalls its scheduler (one Python process); 0 for SGLang
    engine_per_request_s: float = 0.0
    engine_per_input_token_s: float = 0.0  # parsing a request's input_ids
    engine_per_output_token_s: float = 0.0  # writing a reply's output ids and log-probs
    step_overhead_s: float = 0.003
    weight_update_s: float = 0.0
    admit_wait_s: float = 0.0
    max_running: int = 1024
    kv_capacity_tokens: int = 1 << 40
    kv_admission: str = "reserve"  # reserve | optimistic
    optimistic_reserve_frac: float = 0.3  # "optimistic": share of the remaining budget reserved at admission
    max_prefill_tokens: int = 8192  # tokens per batched prefill (later rows wait for the next one)
    pad_slack_tokens: int = 1024  # padded prefills: rows of different lengths share one while rows x longest <= this
    prefill_ragged: bool = False  # True: one unpadded forward per max_prefill_tokens (SGLang's ragged prefill)
    prefill_mode: str = "batched"  # batched: separate prefill forwards | mixed: prompt chunks packed into decode steps
    chunked_prefill_size: int = -1  # "mixed": prompt tokens of one row per step (-1: max_prefill_tokens)
    paged_block_size: int = 0  # > 0: decode rows read whole KV blocks of this size, bucketed as the embedded engine does
    bucket_min_saving: int = BUCKET_MIN_SAVING  # the embedded engine's bucket rule (key positions a new bucket must save)
    graph_max_rows: int = 0  # > 0: decode-only steps of up to this many rows replay CUDA graphs, padded (decode_graphs.py)
    separate_prefill: bool = False  # "mixed": a step's decode rows and prefill chunks in two forwards (see above)
    name: str = "custom"
    source: str = ""  # where the numbers come from (calibration command, datasheets)
    extra: dict = field(default_factory=dict, compare=False)  # calibration details (probes, residuals)

    def __post_init__(self):
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"EngineCostModel.prefill_mode: {self.prefill_mode!r} is not one of {', '.join(PREFILL_MODES)}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1 or self.max_prefill_tokens < 1:
            raise ValueError("EngineCostModel: chunked_prefill_size must be -1 or >= 1 and max_prefill_tokens >= 1, got "
                             f"{self.chunked_prefill_size} / {self.max_prefill_tokens}")
        if self.kv_admission not in ("reserve", "optimistic"):
            raise ValueError(f"EngineCostModel.kv_admission: {self.kv_admission!r} is not reserve or optimistic")
        for f in TIME_FIELDS:
            if not getattr(self, f) >= 0:
                raise ValueError(f"EngineCostModel.{f} must be >= 0, got {getattr(self, f)}")
        if self.decode_base_s + self.decode_per_seq_s <= 0:
            raise ValueError("EngineCostModel: a decode step must cost something (decode_base_s + decode_per_seq_s > 0)")
        if self.max_running < 1 or self.kv_capacity_tokens < 1:
            raise ValueError("EngineCostModel: max_running and kv_capacity_tokens must be >= 1")

    # ---- costs ---------------------------------------------------------------------
    def decode_device_s(self, batch: int, tokens: float, padded: float, extra_buckets: int = 0) -> float:
        """The device's work in a decode step of `batch` rows attending `tokens` keys in all, `padded` key positions
        gathered in 1 + `extra_buckets` buckets (see `decode_read`)."""
        return (self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_token_s * tokens
                + self.decode_per_padded_s * padded + self.decode_per_bucket_s * extra_buckets)

    def with_host(self, device_s: float, rows: int, extra_buckets: int = 0) -> float:
        """A step whose device work takes `device_s`: max(the host issuing it, the device) + the host's tail."""
        issue = self.host_step_s + self.host_per_row_s * rows + self.host_per_bucket_s * extra_buckets
        return max(issue, device_s) + self.host_tail_s + self.host_tail_per_row_s * rows

    def decode_step_s(self, batch: int, tokens: float, padded: float, extra_buckets: int = 0) -> float:
        """A decode step (see `decode_device_s`), the host's part included."""
        return self.with_host(self.decode_device_s(batch, tokens, padded, extra_buckets), batch, extra_buckets)

    def decode_jump(self, batch: int, tokens: float, padded: float, extra_buckets: int = 0) -> tuple[float, float]:
        """(this decode step's seconds, the growth of each next) while the same rows decode."""
        device = self.decode_device_s(batch, tokens, padded, extra_buckets)
        issue = self.host_step_s + self.host_per_row_s * batch + self.host_per_bucket_s * extra_buckets
        growth = 0.0 if issue > device else (self.decode_per_token_s + self.decode_per_padded_s) * batch
        return self.with_host(device, batch, extra_buckets), growth

    def decode_read(self, positions: list[int], graph: bool = True) -> tuple[int, int]:
        """(key positions gathered, buckets beyond the first) of a decode step at `positions`: paged buckets (or a
        CUDA graph's padded shape), else one bucket padded to the longest row."""
        if not positions:
            return 0, 0
        if graph and self.paged_block_size > 0 and len(positions) <= self.graph_max_rows:  # one padded graph bucket
            bs = self.paged_block_size
            return graph_rows(len(positions), self.graph_max_rows) * graph_blocks(max(positions) // bs + 1) * bs, 0
        if self.paged_block_size > 0:
            padded, buckets = decode_shape(positions, self.paged_block_size, self.bucket_min_saving)
            return padded, buckets - 1
        return len(positions) * max(positions), 0

    @property
    def chunk_tokens(self) -> int:
        """"mixed": the most prompt tokens of one row in one step."""
        return self.chunked_prefill_size if self.chunked_prefill_size > 0 else self.max_prefill_tokens

    def mixed_step_s(self, batch: int, tokens: float, padded: float, extra_buckets: int, prefill_tokens: int,
                     key_pairs: float, chunks: int = 1) -> float:
        """"mixed": a step decoding `batch` rows, prefilling `prefill_tokens` in `chunks` (`key_pairs` attended)."""
        if self.separate_prefill and batch and prefill_tokens:
            return (self.decode_step_s(batch, tokens, padded, extra_buckets)
                    + self.mixed_step_s(0, 0, 0, 0, prefill_tokens, key_pairs, chunks))
        cost = self.decode_device_s(batch, tokens, padded, extra_buckets) if batch else self.decode_base_s
        if prefill_tokens:
            cost += (self.prefill_base_s + self.prefill_per_chunk_s * chunks + self.prefill_per_token_s * prefill_tokens
                     + self.prefill_per_token2_s * key_pairs)
        return self.with_host(cost, batch + (chunks if prefill_tokens else 0), extra_buckets)

    def on_counters(self, st: dict) -> tuple[float, float]:
        """The model's seconds for the steps an engine counted (`scheduler_stats` deltas): (decode-only steps,
        steps with prefill tokens); the second only in "mixed" mode with the engine's mixed-step counters."""
        g = st.get
        dec = (self.decode_base_s * g("decode_steps", 0) + self.decode_per_seq_s * g("decode_rows", 0)
               + self.decode_per_token_s * g("decode_ctx_tokens", 0) + self.decode_per_padded_s * g("decode_padded", 0)
               + self.decode_per_bucket_s * max(0, g("decode_buckets", 0) - g("decode_steps", 0)))
        # the host's part over the same steps, from the sums (max of the sums: each step's own max is not known)
        dec = self._host_on_sums(dec, g("decode_steps", 0), g("decode_rows", 0),
                                 max(0, g("decode_buckets", 0) - g("decode_steps", 0)))
        if self.prefill_mode == "mixed":
            pre = ((self.decode_base_s + self.prefill_base_s) * g("prefills", 0)
                   + self.decode_per_seq_s * g("prefill_decode_rows", 0)
                   + self.decode_per_token_s * g("prefill_decode_ctx_tokens", 0)
                   + self.decode_per_padded_s * g("prefill_decode_padded", 0)
                   + self.decode_per_bucket_s * max(0, g("prefill_decode_buckets", 0) - g("prefill_decode_steps", 0))
                   + self.prefill_per_chunk_s * g("prefill_rows", 0)
                   + self.prefill_per_token_s * g("prefill_tokens", 0) + self.prefill_per_token2_s * g("prefill_key_pairs", 0))
            pre = self._host_on_sums(pre, g("prefills", 0), g("prefill_decode_rows", 0) + g("prefill_rows", 0),
                                     max(0, g("prefill_decode_buckets", 0) - g("prefill_decode_steps", 0)))
        else:
            pre = self.prefill_base_s * g("prefills", 0) + self.prefill_per_token_s * g("prefill_positions", 0)
        return dec, pre

    def _host_on_sums(self, device_s: float, steps: float, rows: float, extra_buckets: float) -> float:
        if not steps:
            return device_s
        issue = self.host_step_s * steps + self.host_per_row_s * rows + self.host_per_bucket_s * extra_buckets
        return max(issue, device_s) + self.host_tail_s * steps + self.host_tail_per_row_s * rows

    def prefill_s(self, lengths: list[int]) -> float:
        """Seconds to prefill rows of `lengths`, split into forwards as the engine would."""
        if not lengths:
            return 0.0
        if self.prefill_ragged:  # one ragged forward per max_prefill_tokens, no padding (SGLang)
            total = sum(lengths)
            forwards = -(-total // max(1, self.max_prefill_tokens))
            return (self.prefill_base_s * forwards + self.prefill_per_token_s * total
                    + self.prefill_per_token2_s * sum(x * x for x in lengths))
        cost = 0.0
        for chunk in prefill_chunks(lengths, self.pad_slack_tokens):  # left-padded to the chunk's longest
            rows, width = len(chunk), max(chunk)
            cost += self.prefill_base_s + self.prefill_per_token_s * rows * width + self.prefill_per_token2_s * rows * width * width
        return cost

    def tokens_per_s(self, batch: int, context: int) -> float:
        """Steady decode throughput of `batch` sequences of `context` cached tokens each."""
        return batch / self.decode_step_s(batch, batch * context, *self.decode_read([context] * batch))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "cost model") -> "EngineCostModel":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(names))})")
        if "decode_base_s" not in d:
            raise ValueError(f"{where}: missing field 'decode_base_s'")
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, path: str) -> "EngineCostModel":
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not a JSON cost model ({e})") from e
        return cls.from_dict(d, where=path)

    def replace(self, **kw) -> "EngineCostModel":
        return dataclasses.replace(self, **kw)

    def scaled(self, factor: float) -> "EngineCostModel":
        """Every duration times `factor` (a machine `factor` times slower; admission waits are timers, kept)."""
        return dataclasses.replace(self, **{f: getattr(self, f) * factor for f in TIME_FIELDS})

    def describe(self) -> str:
        return (f"{self.name}: decode step {1e3 * self.decode_base_s:.3f} ms + {1e6 * self.decode_per_seq_s:.2f} us/seq "
                f"+ {1e9 * self.decode_per_token_s:.3f} ns/cached token + {1e9 * self.decode_per_padded_s:.3f} ns/padded "
                f"position + {1e6 * self.decode_per_bucket_s:.1f} us/extra bucket; host: issue {1e3 * self.host_step_s:.3f} ms + "
                f"{1e6 * self.host_per_row_s:.2f} us/row + {1e6 * self.host_per_bucket_s:.1f} us/extra bucket, tail "
                f"{1e3 * self.host_tail_s:.3f} ms + {1e6 * self.host_tail_per_row_s:.2f} us/row; prefill {1e3 * self.prefill_base_s:.3f} "
                f"ms/forward + {1e6 * self.prefill_per_chunk_s:.1f} us/chunk + {1e6 * self.prefill_per_token_s:.3f} us/token "
                f"+ {1e12 * self.prefill_per_token2_s:.3f} ps/token^2 ({self.prefill_mode}); abort {1e3 * self.abort_s:.1f} ms, request "
                f"{1e3 * self.request_latency_s:.2f} ms, step overhead {1e3 * self.step_overhead_s:.1f} ms, weight update "
                f"{self.weight_update_s:.2f} s, client {1e3 * self.client_per_request_s:.2f} ms/request + {1e6 * self.client_per_input_token_s:.2f} us/input + {1e6 * self.client_per_token_s:.2f} us/output token, engine HTTP "
                f"{1e3 * self.engine_per_request_s:.2f} ms/request + {1e6 * self.engine_per_input_token_s:.2f} us/input "
                f"+ {1e6 * self.engine_per_output_token_s:.2f} us/output token; max running {self.max_running}, KV {self.kv_capacity_tokens} tokens "
                f"({self.kv_admission})")


def prefill_chunks(lengths: list[int], pad_slack: int) -> list[list[int]]:
    """Rows grouped into padded prefill forwards, shortest first: equal lengths share one; different
    lengths share one while rows x longest stays within `pad_slack` (the embedded engine's rule)."""
    out: list[list[int]] = []
    cur: list[int] = []
    for n in sorted(lengths):
        if cur and n != cur[0] and (len(cur) + 1) * n > pad_slack:
            out.append(cur)
            cur = []
        cur.append(n)
    if cur:
        out.append(cur)
    return out


def nnls_fit(rows: list[list[float]], targets: list[float], names: tuple[str, ...],
             weights: list[float] | None = None) -> tuple[dict[str, float], float]:
    """Non-negative least squares (exhaustive active set): (coefficients, relative RMS residual)."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(targets, dtype=float)
    w = np.ones_like(y) if weights is None else np.asarray(weights, dtype=float)
    aw, yw = a * w[:, None], y * w
    best = None
    k = a.shape[1]
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            coef, *_ = np.linalg.lstsq(aw[:, cols], yw, rcond=None)
            if (coef < 0).any():
                continue
            resid = float(np.sum((aw[:, cols] @ coef - yw) ** 2))
            if best is None or resid < best[0] - 1e-18:
                full = np.zeros(k)
                full[list(cols)] = coef
                best = (resid, full)
    if best is None:
        raise ValueError("nnls_fit: no non-negative fit")
    full = best[1]
    pred = a @ full
    rel = float(np.sqrt(np.mean(((pred - y) / np.where(y > 0, y, 1)) ** 2)))
    return {n: float(c) for n, c in zip(names, full)}, rel
