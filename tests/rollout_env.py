"""The APRIL rollout tests' engine group (a random 1-layer tiny Qwen3, so lengths vary), flags, data sources, and
the reward / filter plugins they name by dotted path (`rollout_env.<name>`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import requests

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.ray.buffer import PartialRolloutBuffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.ledger import TRAINED
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer
from slime.utils.types import Status

SPEC = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, max_position_embeddings=256)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("april")
    tok = build_tokenizer(VOCAB)
    model = build_tiny_qwen3(str(root / "model"), tok, SPEC, seed=3)
    write_dataset(str(root / "prompts.jsonl"), 300, seed=0)
    base = make_args(root)
    group = EngineGroup(base, log_dir=str(root / "logs")).start()
    yield {"root": root, "tok": tok, "model": model.eval(), "engines": group}
    group.shutdown()


def make_args(root, *extra):
    return parse_args([
        "--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "prompts.jsonl"),
        "--label-key", "label", "--rm-type", "subtract_chain", "--num-rollout", "4", "--rollout-backend", "embedded",
        "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
        "--sglang-server-concurrency", "6", "--rollout-seed", "7", "--run-dir", str(root / "run"), *extra])


class RecordingSource(RolloutDataSource):
    """The real data source, remembering each fresh group's prompt ids (to check tokens later)."""

    def __init__(self, args, tok):
        super().__init__(args, tok)
        self.prompts: dict[int, list[int]] = {}
        self.calls: list[list[int]] = []

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            self.prompts[g[0].group_index] = list(g[0].tokens)
        self.calls.append([g[0].group_index for g in groups])
        return groups


def set_version(env, version: int) -> None:
    for url in env["engines"].worker_urls():
        r = requests.post(url + "/update_weight_version", json={"new_version": str(version)}, timeout=30)
        assert r.json()["success"], r.text


def run_steps(env, args, steps, source=None, buffer=None, first_version=0, train=True):
    source = source or RecordingSource(args, env["tok"])
    buffer = buffer if buffer is not None else PartialRolloutBuffer(args)
    outs = []
    for step in range(steps):
        version = first_version + step
        set_version(env, version)
        ctx = engine_rollout(args, buffer, source, env["engines"], policy_version=version).context()
        out = generate_rollout(args, step, ctx)
        outs.append(out)
        if train:
            buffer.mark([g[0].group_index for g in out.groups], TRAINED)
    return source, buffer, outs


def check_group_invariants(groups, n, prompts, version, max_len):
    for g in groups:
        assert len(g) == n and len({s.group_index for s in g}) == 1
        for s in g:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)
            assert s.tokens[: s.prompt_length] == prompts[s.group_index]
            assert len(s.rollout_log_probs) == len(s.weight_versions) == len(s.loss_mask) == s.response_length
            assert 0 < s.response_length <= max_len
            assert s.weight_versions == sorted(s.weight_versions) and s.weight_versions[-1] <= version
            assert all(lp <= 0 for lp in s.rollout_log_probs)
            assert s.reward is not None or s.status == Status.FAILED


class ShortAndLongSource(RecordingSource):
    """Every group's first member may write 2 tokens, the others the whole budget (in the sample's metadata)."""

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            g[0].metadata["max_response_len"] = 2
        return groups


class LongFirstSource(RecordingSource):
    """Of every four groups the first two may write the whole budget, the others 2 tokens: with EOS ignored, the short
    groups meet a step's target while the long ones, submitted first, are still generating (parked with tokens)."""

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            if g[0].group_index % 4 >= 2:
                for s in g:
                    s.metadata["max_response_len"] = 2
        return groups


def only_even_groups(args, samples):
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput

    return DynamicFilterOutput(keep=samples[0].group_index % 2 == 0, reason="odd group")


async def failing_rm(args, sample):
    if sample.index % 3 == 0:
        raise RuntimeError("judge unavailable")
    return 1.0


SLOW_HOLD_SAFETY_S = 30.0  # a safety net only (below --reward-timeout): the step drains long before


class SlowRewardGate:
    """Groups 0 and 1 are rewarded slowly: their rewards end only once the step has drained (the test sets
    `drained` right after stop_and_drain returns). Two other groups are rewarded at once and meet the target of
    2. Ordered by events, not by a race of sleeps against generation speed: a drain that waited for these
    rewards would never end, and the rewards would give up (recorded in `gave_up`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.rewarded: dict[int, int] = {}  # fast group -> members rewarded
        self.fast_groups_done = threading.Event()
        self.drained = threading.Event()
        self.slow_done: list[int] = []  # sample indices of the slow rewards that ended after the drain
        self.gave_up: list[int] = []  # ... and of those that stopped waiting for it


SLOW_GATE = SlowRewardGate()


async def slow_rm(args, sample):
    gate = SLOW_GATE
    if sample.group_index in (0, 1):
        deadline = time.monotonic() + SLOW_HOLD_SAFETY_S
        while not gate.drained.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with gate.lock:
            (gate.slow_done if gate.drained.is_set() else gate.gave_up).append(sample.index)
    else:
        with gate.lock:
            gate.rewarded[sample.group_index] = gate.rewarded.get(sample.group_index, 0) + 1
            if sum(n == args.n_samples_per_prompt for n in gate.rewarded.values()) >= 2:
                gate.fast_groups_done.set()
    return 0.5


class SlowFirstSource(RecordingSource):
    """Groups 0 and 1 may write 2 tokens (so they finish generating first and reach the slow reward)."""

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            if g[0].group_index in (0, 1):
                for s in g:
                    s.metadata["max_response_len"] = 2
        return groups


class OverlongSource(RecordingSource):
    """Group 1's prompt is made longer than the model's 256 positions after load (as a tokenizer or
    template change on resume could): the engine refuses it mid-run."""

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            if g[0].group_index == 1:
                for s in g:
                    s.tokens = s.tokens * (300 // len(s.tokens) + 1)
        return groups


async def always_failing_rm(args, sample):
    raise ZeroDivisionError("division by zero")


class StalledRewardGate:
    """Every reward waits (`stalled_rm`) until every row handed out is waiting in it (a step that stopped
    submitting: `released_by` "all_waiting"), or until six budgets of rows wait (one that never stops:
    "runaway"). `StalledSource` records, at each hand-out before the release, how many rows were waiting."""

    def __init__(self, budget: int):
        self.lock = threading.Lock()
        self.budget = budget  # rows: what the supply keeps in flight at most
        self.waiting = self.handed_out = 0
        self.waiting_at_hand_out: list[int] = []
        self.released = threading.Event()
        self.released_by: str | None = None


STALL = StalledRewardGate(0)
STALL_SAFETY_S = 30.0  # a safety net only (below --reward-timeout): either release comes long before


async def stalled_rm(args, sample):
    gate = STALL
    with gate.lock:
        gate.waiting += 1
        if not gate.released.is_set() and gate.waiting >= 6 * gate.budget:
            gate.released_by = "runaway"
        elif not gate.released.is_set() and gate.waiting == gate.handed_out:
            gate.released_by = "all_waiting"
        if gate.released_by:
            gate.released.set()
    deadline = time.monotonic() + STALL_SAFETY_S
    while not gate.released.is_set() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return 0.5


class StalledSource(RecordingSource):
    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        gate = STALL
        with gate.lock:
            if not gate.released.is_set():
                gate.waiting_at_hand_out.append(gate.waiting)
            gate.handed_out += sum(len(g) for g in groups)
        return groups
