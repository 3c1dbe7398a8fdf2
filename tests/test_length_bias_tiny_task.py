"""On the tiny task, APRIL with the staleness cap's `mask` policy trains the synchronous run's length distribution.

Each sample's budget is its prompt's true response length; `restart` loses the long samples. Bounds: docs/metrics.md."""

from __future__ import annotations

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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
SPEC = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, max_position_embeddings=256)
STEPS = 20
LONG_SHARE_BOUND = 0.8
MEAN_BOUND = 0.10


class TaskLengths(RolloutDataSource):
    """The prompt data, each sample's budget its prompt's true response length."""

    def __init__(self, args, tok):
        super().__init__(args, tok)
        self.issued: dict[int, tuple[int, int]] = {}  # group id -> (step issued, true length)
        self.step = 0

    def get_groups(self, num_groups):
        groups = super().get_groups(num_groups)
        for g in groups:
            length = len(g[0].label) + 1  # one token per character of the answer, then EOS
            for s in g:
                s.metadata["max_response_len"] = length
            self.issued[g[0].group_index] = (self.step, length)
        return groups


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("length_bias")
    tok = build_tokenizer(VOCAB)
    build_tiny_qwen3(str(root / "model"), tok, SPEC, seed=5)
    write_dataset(str(root / "prompts.jsonl"), 400, seed=1)
    with EngineGroup(make_args(root), log_dir=str(root / "logs")).start() as group:
        yield {"root": root, "tok": tok, "engines": group}


def make_args(root, *extra):
    return parse_args([
        "--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "prompts.jsonl"), "--label-key", "label",
        "--rm-type", "subtract_chain", "--num-rollout", str(STEPS), "--rollout-backend", "embedded",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "200",
        "--rollout-ignore-eos", "--sglang-server-concurrency", "16", "--rollout-seed", "7",
        "--run-dir", str(root / "run"), *extra])


def run(env, *flags) -> tuple[dict, set[int], list[dict]]:
    """Rollout steps (version bumped before each) until the first STEPS steps' groups trained, at most 3 x STEPS."""
    args = make_args(env["root"], *flags, "--num-rollout", str(3 * STEPS))
    source, buffer = TaskLengths(args, env["tok"]), PartialRolloutBuffer(args)
    trained, metrics = set(), []
    for step in range(3 * STEPS):
        if step >= STEPS and set(first_half(source.issued)) <= trained:
            break
        for url in env["engines"].worker_urls():
            requests.post(url + "/update_weight_version", json={"new_version": str(step), "abort_all_requests": False},
                          timeout=30).raise_for_status()
        source.step = step
        out = generate_rollout(args, step, engine_rollout(args, buffer, source, env["engines"], policy_version=step).context())
        trained.update(g[0].group_index for g in out.groups)
        buffer.mark([g[0].group_index for g in out.groups], TRAINED)
        metrics.append(out.metrics)
    return source.issued, trained, metrics


def first_half(issued: dict) -> dict[int, int]:
    """The groups issued in the first STEPS steps: {group id: true length}."""
    return {gid: length for gid, (step, length) in issued.items() if step < STEPS}


def test_april_with_the_mask_cap_trains_the_synchronous_length_distribution(env):
    _, sync_trained, sync_metrics = run(env)
    issued, trained, metrics = run(env, "--partial-rollout", "--over-sampling-batch-size", "8", "--max-staleness", "1",
                                   "--staleness-policy", "mask")
    prompts = first_half(issued)
    lengths = sorted(prompts.values())
    decile = lengths[int(0.9 * len(lengths))]
    longest = [gid for gid, n in prompts.items() if n >= decile]
    share = sum(gid in trained for gid in longest) / len(longest)
    sync_mean = sum(lengths) / len(lengths)  # a synchronous run trains every prompt it issues, at its length
    reached = [n for gid, n in prompts.items() if gid in trained]
    assert share >= LONG_SHARE_BOUND, (share, longest, sorted(trained))
    assert abs(sum(reached) / len(reached) - sync_mean) <= MEAN_BOUND * sync_mean
    assert any(m["rollout/staleness_mask"] or m["rollout/staleness_masked_tokens_at_train"] for m in metrics)
    # the per-step metrics report it: the synchronous run's trained and sync distributions agree exactly
    assert all(m["length/longest_decile_share"] == pytest.approx(1.0) for m in sync_metrics)
    assert all(m["length/trained_mean"] == pytest.approx(m["length/sync_mean"]) for m in sync_metrics)
    assert len(sync_trained) == 4 * len(sync_metrics)


def test_the_restart_cap_loses_long_samples_and_the_metrics_say_so(env):
    """With `restart`, samples longer than the cap allows are regenerated again and again, and the metrics say so."""
    issued, trained, metrics = run(env, "--partial-rollout", "--over-sampling-batch-size", "8", "--max-staleness", "1",
                                   "--staleness-policy", "restart", "--disable-length-guard")
    prompts = first_half(issued)
    lengths = sorted(prompts.values())
    decile = lengths[int(0.9 * len(lengths))]
    longest = [gid for gid, n in prompts.items() if n >= decile]
    assert sum(m["rollout/staleness_restart"] for m in metrics) > 0
    shares = [m["length/longest_decile_share"] for m in metrics if "length/longest_decile_share" in m]
    lost = sum(gid not in trained for gid in longest) / len(longest)
    assert lost > 0 or min(shares) < 1.0, (lost, shares)
