"""The scheduler's cumulative counters, served in `/get_server_info` (`internal_states[0].scheduler_stats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Cumulative counters of where the scheduler thread's time goes (seconds) and how full its steps are; the `fit_*`
    sums fit step time over decoding rows and prefill tokens (benchmarks/rollout_report.py)."""

    decode_s: float = 0.0  # forward + sampling of steps without prefill tokens
    decode_cpu_s: float = 0.0  # the same in the scheduler thread's CPU time (what a shared machine does not inflate)
    # of decode_s, the time until the step's work was issued: on a GPU launch_s ~ decode_s means a launch-bound
    # step (what CUDA graphs shorten); on the CPU the two are the same
    decode_launch_s: float = 0.0
    # of decode_s, the time after the tokens were back on the host (appending them, finishing rows): host work that
    # nothing overlaps (the simulator's host tail, slime/rollout/simulator/host_fit.py)
    decode_tail_s: float = 0.0
    prefill_s: float = 0.0  # forward + sampling of steps with prefill tokens (and the rows they also decoded)
    prefill_cpu_s: float = 0.0
    prefill_tail_s: float = 0.0  # of prefill_s, the time after the tokens were back, as decode_tail_s
    evict_s: float = 0.0  # finishing rows: freeing or caching their blocks
    idle_s: float = 0.0  # nothing to run (or paused)
    # the scheduler thread's work outside steps: taking requests and commands from the HTTP side, admitting rows
    admin_s: float = 0.0
    requests_in: int = 0  # requests handed to the scheduler
    decode_steps: int = 0
    decode_rows: int = 0  # sum over decode-only steps of the rows decoded
    decode_ctx_tokens: int = 0  # sum over decode-only steps of the rows' cached tokens (the keys they attend)
    decode_padded: int = 0  # sum over decode-only steps of the key positions gathered (buckets padded to blocks)
    decode_buckets: int = 0  # sum over decode-only steps of their attention buckets (each costs a few small ops)
    prefills: int = 0  # steps with prefill tokens
    prefill_decode_steps: int = 0  # those of them that also decoded rows
    prefill_decode_rows: int = 0  # rows decoded in those steps
    prefill_decode_ctx_tokens: int = 0  # their cached tokens (the keys they attend), as decode_ctx_tokens
    prefill_decode_padded: int = 0  # the key positions their decode buckets gathered, as decode_padded
    prefill_decode_buckets: int = 0  # their decode buckets, as decode_buckets
    prefill_key_pairs: int = 0  # (query, key) pairs of the prefill chunks' attention: a chunk of c at p0 has c x p0 + c(c+1)/2
    prefill_rows: int = 0  # prefill segments (a chunk of one row's prompt)
    prefill_tokens: int = 0
    prefill_positions: int = 0  # positions prefilled (packed, so no padding: = prefill_tokens)
    sampled_tokens: int = 0  # tokens generated (one per decoding row, one per finished prefill)
    cache_hits: int = 0  # requests that resumed an aborted request's KV
    cache_hit_tokens: int = 0  # positions they did not prefill
    # requests that started on the KV of a running request with the same prompt (a group's samples), and the
    # prompt positions they did not prefill
    shared_prompts: int = 0
    shared_prompt_tokens: int = 0
    # hits on KV that older weights computed (a request with the entry's extra_key, or none, after an update with
    # flush_cache=false): never with version-keyed requests (slime/rollout/engine_versions.py)
    cache_stale_hits: int = 0
    cache_stale_hit_tokens: int = 0
    retractions: int = 0  # running requests sent back to the queue with their KV dropped (a pause or an update)
    retracted_tokens: int = 0  # the KV positions they dropped (prefilled again when they run again)
    # sums for a least-squares fit of step time ~ a + b x decoding rows + c x prefill tokens (thousands),
    # over any window of steps (differences of these sums): what a step, a row and a prefilled token cost
    fit_n: int = 0
    fit_d: float = 0.0
    fit_p: float = 0.0
    fit_dd: float = 0.0
    fit_pp: float = 0.0
    fit_dp: float = 0.0
    fit_t: float = 0.0
    fit_td: float = 0.0
    fit_tp: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def record_step(self, *, wall: float, cpu: float, launch: float, tail: float, decoded: int, decode_ctx: int,
                    prefill_tokens: int, prefill_pairs: int, prefill_rows: int, sampled: int,
                    buckets: list[tuple[int, int]], block_size: int) -> None:
        """One engine step: its wall and thread CPU seconds (of them: until its work was issued, after its tokens
        were back), its decoding rows and their cached tokens, its prefill tokens, (query, key) pairs and rows, the
        tokens it sampled, and its attention buckets as (queries per row, rows x key blocks)."""
        self.add_step(wall, decoded, prefill_tokens)
        self.sampled_tokens += sampled
        decode_blocks = sum(blocks for q, blocks in buckets if q == 1)
        decode_buckets = sum(q == 1 for q, _ in buckets)
        if prefill_tokens:
            self.prefill_s += wall
            self.prefill_cpu_s += cpu
            self.prefill_tail_s += tail
            self.prefills += 1
            self.prefill_decode_rows += decoded
            self.prefill_decode_ctx_tokens += decode_ctx
            self.prefill_decode_padded += decode_blocks * block_size
            self.prefill_decode_buckets += decode_buckets
            self.prefill_key_pairs += prefill_pairs
            self.prefill_decode_steps += decoded > 0
            self.prefill_rows += prefill_rows
            self.prefill_tokens += prefill_tokens
            self.prefill_positions += prefill_tokens  # packed: no padding
        else:
            self.decode_s += wall
            self.decode_cpu_s += cpu
            self.decode_launch_s += launch
            self.decode_tail_s += tail
            self.decode_steps += 1
            self.decode_rows += decoded
            self.decode_ctx_tokens += decode_ctx
            self.decode_padded += decode_blocks * block_size
            self.decode_buckets += decode_buckets

    def add_step(self, seconds: float, decoded: int, prefill_tokens: int) -> None:
        d, p = decoded / 1000.0, prefill_tokens / 1000.0
        self.fit_n += 1
        self.fit_d += d
        self.fit_p += p
        self.fit_dd += d * d
        self.fit_pp += p * p
        self.fit_dp += d * p
        self.fit_t += seconds
        self.fit_td += seconds * d
        self.fit_tp += seconds * p
