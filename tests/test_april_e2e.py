"""APRIL across process boundaries."""

from __future__ import annotations

import os
import signal

import pytest
import ray

from slime.arguments import parse_args
from slime.backends.sglang_utils.engine_group import EngineGroup
from slime.ray.buffer import Buffer
from slime.rollout.data_source import RolloutDataSource
from slime.rollout.sglang_rollout import RolloutError, engine_rollout, generate_rollout
from slime.tasks.subtract_chain import VOCAB, write_dataset
from slime.utils.ledger import FINISHED, PARKED, TRAINED
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

pytestmark = pytest.mark.slow
T = 60
SPEC = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, max_position_embeddings=512)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("april_e2e")
    tok = build_tokenizer(VOCAB)
    build_tiny_qwen3(str(root / "model"), tok, SPEC, seed=5)
    write_dataset(str(root / "prompts.jsonl"), 100, seed=1)
    group = EngineGroup(make_args(root), log_dir=str(root / "logs")).start()
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield {"root": root, "tok": tok, "engines": group}
    group.shutdown()
    if started:
        ray.shutdown()


def make_args(root, *extra):
    return parse_args([
        "--hf-checkpoint", str(root / "model"), "--prompt-data", str(root / "prompts.jsonl"), "--label-key", "label",
        "--rm-type", "subtract_chain", "--num-rollout", "3", "--rollout-backend", "embedded", "--partial-rollout",
        "--rollout-batch-size", "3", "--over-sampling-batch-size", "6", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "32", "--sglang-server-concurrency", "6", "--run-dir", str(root / "run"), *extra])


def ids(groups):
    return [g[0].group_index for g in groups]


def test_ray_buffer_save_restart_resume_never_trains_twice(env, tmp_path):
    args = make_args(env["root"])
    source = RolloutDataSource(args, env["tok"])
    buf = Buffer.remote(args)
    trained: list[int] = []
    # The abort races the engine: on a loaded box every over-sampled group can finish before it lands, and the step
    # then parks nothing. Steps before the checkpoint run until one has parked something (nearly always the first).
    step, parked_before = -1, []
    while not parked_before:
        step += 1
        assert step < 4, "no step parked a group before the checkpoint"
        out = generate_rollout(args, step, engine_rollout(args, buf, source, env["engines"], policy_version=step).context())
        ray.get(buf.mark.remote(ids(out.groups), TRAINED), timeout=T)
        trained += ids(out.groups)
        parked_before = ray.get(buf.parked_ids.remote(), timeout=T)
    before_restart = step + 1
    # checkpoint: buffer + data source, then "crash" (a new actor and a new data source)
    ray.get(buf.save.remote(str(tmp_path / "buffer.json")), timeout=T)
    ds_state = source.state_dict()
    ray.kill(buf)
    buf2 = Buffer.remote(args)
    ray.get(buf2.load.remote(str(tmp_path / "buffer.json")), timeout=T)
    source2 = RolloutDataSource(args, env["tok"])
    source2.load_state_dict(ds_state)
    assert ray.get(buf2.parked_ids.remote(), timeout=T) == parked_before
    # Step 0's overflow (finished, held ready) counts first, so a step may be filled by ready groups alone and
    # submit nothing; the parked groups must be resumed in the first step that submits, ahead of any fresh group.
    submitted = False
    while step < before_restart + 1 or not submitted:
        step += 1
        assert step <= before_restart + 3, "no step after the restart submitted a group"
        parked_now = ray.get(buf2.parked_ids.remote(), timeout=T)
        out = generate_rollout(args, step, engine_rollout(args, buf2, source2, env["engines"], policy_version=step).context())
        assert len(out.groups) == 3
        m = out.metrics
        if m["rollout/groups_submitted"] > 0 and not submitted:
            submitted = True
            assert parked_now == parked_before
            assert m["rollout/groups_resumed"] > 0
            assert m["rollout/groups_resumed"] == len(parked_before) or m["rollout/groups_fresh"] == 0
        elif not submitted:  # filled by the ready groups alone
            assert m["rollout/groups_ready_in"] == 3
        assert not set(ids(out.groups)) & set(trained)
        ray.get(buf2.mark.remote(ids(out.groups), TRAINED), timeout=T)
        trained += ids(out.groups)
    with pytest.raises(ray.exceptions.RayTaskError, match="invalid ledger transition"):  # refused through Ray too
        ray.get(buf2.mark.remote(trained[:1], TRAINED), timeout=T)
    summary = ray.get(buf2.check_balanced.remote(), timeout=T)
    assert summary[TRAINED] == len(trained) == len(set(trained)) == 3 * (step + 1)
    assert summary["total"] == source2.group_counter


async def kill_engine_rm(args, sample):
    """Reward that SIGKILLs the engine the first time it runs (pid from the environment)."""
    pid = int(os.environ.get("APRIL_TEST_ENGINE_PID", "0"))
    if pid:
        os.environ["APRIL_TEST_ENGINE_PID"] = "0"
        os.kill(pid, signal.SIGKILL)
    return 1.0


def test_engine_killed_mid_rollout_raises_and_keeps_finished_groups(env, monkeypatch):
    # runs last in this module: it kills the module's engine
    args = make_args(env["root"], "--rm-type", "math", "--custom-rm-path", f"{__name__}.kill_engine_rm",
                     "--rollout-max-response-len", "400", "--rollout-batch-size", "6", "--over-sampling-batch-size", "12")
    engines = env["engines"]
    monkeypatch.setenv("APRIL_TEST_ENGINE_PID", str(engines.engines[0].pid))
    source = RolloutDataSource(args, env["tok"])
    buf = Buffer.remote(args)
    with pytest.raises(RolloutError, match=r"rollout step 0 failed: engine 0 \(http://.*\) exited with code -9 "
                                           r"\(killed by SIGKILL\)") as info:
        generate_rollout(args, 0, engine_rollout(args, buf, source, engines, policy_version=0).context())
    assert "kept" in str(info.value)
    assert [f.rank for f in info.value.faults] == [0]  # an EngineFaultError: restartable by rank
    summary = ray.get(buf.check_balanced.remote(), timeout=T)  # nothing left issued: every group accounted for
    assert summary["total"] == source.group_counter
    ready = ray.get(buf.take_ready.remote(100), timeout=T)
    assert ready and summary[FINISHED] == len(ready)  # the group(s) rewarded before the crash are kept
    assert all(s.reward == 1.0 and s.status.is_finished for g in ready for s in g)
    assert summary[PARKED] == ray.get(buf.num_parked.remote(), timeout=T)
