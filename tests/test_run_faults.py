"""What a run says when a part of it dies."""

from __future__ import annotations

import json
import logging
import os

import pytest
import ray

from slime.ray.actor_group import TrainerRankError, wait_ranks
from slime.ray.run_faults import RunRecord, RunStopped, cause_lines, explain
from slime.ray.train_loop import train_or_stop
from slime.utils.run import init_ray, setup_logging


@pytest.fixture
def run_log(tmp_path):
    """setup_logging into tmp_path/train.log as a run does; the test's own logging is put back after."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    setup_logging(str(tmp_path))
    yield tmp_path / "train.log"
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def _lines(path) -> list[str]:
    return [line.split(": ", 1)[1] if " train: " in line else line for line in path.read_text().splitlines()]


def test_every_fatal_error_ends_train_log_and_stderr_with_its_reason(run_log, capsys):
    def named(args):
        try:
            raise OSError("disk gone")
        except OSError as e:
            raise RunStopped("rollout step 3 failed: engine 0 exited; `--load x` resumes at step 2") from e

    assert train_or_stop("train.py", named, None) == 1
    err = capsys.readouterr().err.rstrip().splitlines()
    assert err[-1] == "train.py: error: rollout step 3 failed: engine 0 exited; `--load x` resumes at step 2"
    lines = _lines(run_log)
    assert lines[-1] == "stopped: rollout step 3 failed: engine 0 exited; `--load x` resumes at step 2"
    assert lines[-2] == "because of OSError: disk gone"  # the cause chain, just above the reason
    assert "Traceback" in run_log.read_text()  # OSError does not name its cause: where it came from is logged

    def unexpected(args):
        {}["missing"]

    assert train_or_stop("train.py", unexpected, None) == 1
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == "train.py: error: KeyError: 'missing'"
    assert _lines(run_log)[-1] == "stopped: KeyError: 'missing'"


def test_cause_lines_leave_out_what_the_error_above_already_says():
    inner = ValueError("engine 0 died")
    middle = RuntimeError("step 2 failed: engine 0 died")
    middle.__cause__ = inner
    top = RunStopped("step 2 failed: engine 0 died; resume at 2")
    top.__cause__ = middle
    assert cause_lines(top) == []
    middle.__cause__ = ValueError("connection reset")
    assert cause_lines(top) == ["ValueError: connection reset"]


def test_resume_hints():
    assert RunRecord(None).resume_hint() == "nothing to resume from (--save is not set)"
    assert RunRecord("/c").resume_hint() == "no checkpoint in /c yet: a new run starts at step 0"
    assert RunRecord("/c", checkpoint=4).resume_hint() == "`--load /c` resumes at step 5 (checkpoint iter_0000004)"


@pytest.fixture(scope="module")
def ray_node():
    init_ray(num_cpus=2)
    yield
    ray.shutdown()


def _wait_dead(actor) -> Exception:
    """The error a call to `actor` gets once Ray has seen it die."""
    for _ in range(600):  # each round waits for a reply or the death, never a fixed time
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=60)
        except ray.exceptions.RayActorError as e:
            return e
    raise AssertionError("the killed actor kept answering")


def test_a_dead_ray_actor_is_named_by_its_role_with_what_it_held(ray_node):
    from slime.ray.buffer import Buffer

    record = RunRecord("/ckpt", step=5, checkpoint=3, at_checkpoint={"parked": 12, "finished": 2},
                       ledger={"parked": 5, "finished": 1}, policy_version=7)
    buffer = Buffer.remote(None)
    record.actors[buffer._actor_id.hex()] = "the buffer actor"
    ray.kill(buffer, no_restart=True)
    died = _wait_dead(buffer)
    assert explain(died, record, names_itself=False) == (
        "the buffer actor died (ActorDiedError): it held the ledger of every group and 5 parked and 1 ready groups "
        "after the last step; checkpoint iter_0000003 holds 12 parked and 2 ready groups and the ledger of step 3; "
        "stopped in step 5: `--load /ckpt` resumes at step 4 (checkpoint iter_0000003)")

    @ray.remote(num_cpus=0)
    class Rank:
        def pid(self):
            return os.getpid()

        def train(self):
            return "done"

    ranks = [Rank.remote(), Rank.remote()]
    pids = ray.get([r.pid.remote() for r in ranks])
    for rank, (actor, pid) in enumerate(zip(ranks, pids)):
        record.actors[actor._actor_id.hex()] = f"trainer rank {rank} (pid {pid})"
    ray.kill(ranks[1], no_restart=True)
    _wait_dead(ranks[1])
    with pytest.raises(TrainerRankError) as failed:
        wait_ranks([r.train.remote() for r in ranks], "trainer.train", timeout=60, pids=pids)
    assert failed.value.rank == 1 and failed.value.died
    reason = explain(failed.value, record, names_itself=True)
    assert reason.startswith(f"trainer.train: trainer rank 1 (pid {pids[1]}) failed: its process died (ActorDiedError")
    assert (f"; trainer rank 1 (pid {pids[1]}) died (ActorDiedError): it held the weights and optimizer state of "
            "policy version 7; checkpoint iter_0000003 holds those of step 3; stopped in step 5: `--load /ckpt` "
            "resumes at step 4") in reason


def test_a_dead_buffer_actor_starts_again_from_the_checkpoint_and_replays_the_calls_since(ray_node, tmp_path):
    """--use-fault-tolerance: the new actor holds what the dead one held (parked tokens included), a call cut by the
    death runs once (in the replay), the restart is counted; once the budget is spent the death is named."""
    from types import SimpleNamespace

    from test_buffer import make_group

    from slime.ray.buffer import BufferRestartsExhausted, RestartableBuffer
    from slime.ray.restarts import RestartBudget
    from slime.rollout.buffer import call_sync
    from slime.utils.ledger import DROPPED, FINISHED, TRAINED

    budget = RestartBudget(1)
    buffer = RestartableBuffer(SimpleNamespace(save=str(tmp_path), rollout_rpc_timeout=60.0, buffer_filter_path=None),
                               budget)

    def call(method, *args):
        return call_sync(buffer, method, *args, timeout=60.0)

    def state(name):
        call("save", str(tmp_path / name))
        return json.loads((tmp_path / name).read_text())

    call("drop_rows", {7: "over_context_length: 900 tokens"})
    call("issue", [make_group(g) for g in range(4)])  # step 0, then its checkpoint
    call("mark", [0, 1], FINISHED)
    call("mark", [3], DROPPED, "reward_failed: ZeroDivisionError")
    call("park", [make_group(2, tokens=3)])
    call("mark", [0, 1], TRAINED)
    state("ckpt.json")
    buffer.checkpointed(str(tmp_path / "ckpt.json"))
    # two steps since the checkpoint: group 2 parked again with more tokens each time
    assert [g[0].group_index for g in call("take_parked", 4)] == [2]
    call("issue", [make_group(4), make_group(5, finished=2)])
    call("park", [make_group(2, tokens=4), make_group(4, tokens=2)])
    call("mark", [5], FINISHED)
    call("hold_ready", [make_group(5, finished=2)])
    assert [g[0].group_index for g in call("take_ready", 4)] == [5]
    assert [g[0].group_index for g in call("take_parked", 4)] == [2, 4]
    call("issue", [make_group(6, finished=2), make_group(7)])
    call("mark", [4], FINISHED)
    call("mark", [4, 5], TRAINED)
    call("park", [make_group(2, tokens=5)])
    call("mark", [6], FINISHED)
    call("hold_ready", [make_group(6, finished=2)])
    before = state("before.json")
    assert len(buffer.journal) == 13 and before["ledger"]["state"]["2"] == "parked"

    dead = buffer.actor
    ray.kill(dead, no_restart=True)
    _wait_dead(dead)
    call("park", [make_group(7, tokens=1)])  # sent to the dead actor: runs once, in the replay
    assert budget.counts["buffer"] == 1 and buffer.actor is not dead
    after = state("after.json")
    assert after["ledger"]["state"].pop("7") == "parked" and after["parked"].pop()[0]["group_index"] == 7
    assert before["ledger"]["state"].pop("7") == "issued"
    assert after == before  # parked tokens, ready groups, ledger and dropped rows as the dead actor held them

    record = RunRecord("/ckpt", step=3, checkpoint=0)
    record.actors[buffer.actor._actor_id.hex()] = "the buffer actor"
    ray.kill(buffer.actor, no_restart=True)
    _wait_dead(buffer.actor)
    with pytest.raises(BufferRestartsExhausted) as spent:
        call("num_parked")
    assert "giving up on the buffer actor after 1 restart(s) (--max-engine-restarts 1" in str(spent.value)
    assert "; the buffer actor died (ActorDiedError): it held the ledger of every group" in explain(
        spent.value, record, names_itself=True)


def test_only_a_dead_rank_or_one_out_of_memory_is_worth_a_restart(ray_node):
    """A restarted trainer would raise a bug's error again: only a death or an out-of-memory error is recovered."""
    import torch

    @ray.remote(num_cpus=0)
    def step(kind: str):
        if kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        raise ValueError("loss plugin: bad shape")

    with pytest.raises(TrainerRankError) as oom:
        wait_ranks([step.remote("oom")], "trainer.train", timeout=60)
    with pytest.raises(TrainerRankError) as bug:
        wait_ranks([step.remote("bug")], "trainer.train", timeout=60)
    assert oom.value.recoverable and not oom.value.died and "CUDA out of memory" in str(oom.value)
    assert not bug.value.recoverable and "loss plugin: bad shape" in str(bug.value)
