"""--admission: the pool's in-flight controller (slime/rollout/admission.py), its load reports, and in the simulator."""

from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace

import pytest

from slime.rollout.admission import AdmissionControl, AimdRule, LoadPoll
from slime.rollout.simulator import EngineCostModel, ParetoLengths, SimConfig, simulate


def load(running=0, waiting=0, usage=0.1, cap=64, retracted=0) -> dict:
    return {"num_running_reqs": running, "num_waiting_reqs": waiting, "token_usage": usage,
            "max_running_requests": cap, "queues": {"retracted": retracted}}


def test_fixed_never_moves():
    c = AdmissionControl("fixed", 40, 4)
    for ld in ([load(waiting=30)], [load(retracted=3)], [load(running=40)]):
        assert c.observe(ld, 40) == 40
    assert c.metrics() == {}


def test_auto_starts_at_the_engines_capacity_and_follows_their_loads():
    assert AdmissionControl("auto", 512, 4, batch=64).observe([load(cap=64), load(cap=64)], 0) == 64  # one batch
    c = AdmissionControl("auto", 512, 4)
    assert c.observe([load(cap=64), load(cap=64)], 0) == 128  # two engines' batch capacity, under the ceiling
    c.observe([load(running=60, waiting=1), load(running=60)], 128)  # saturated, no queue: the loads allow more
    assert (c.limit, c.cap) == (128, 132)
    c.observe([load(running=60), load(running=60)], 100)  # not every slot in use: no growth
    assert c.cap == 132
    # a queue in one report (rows being admitted) is not a signal; in two, the engines run all they can: the limit
    # goes down to what runs plus the slack
    assert c.observe([load(running=50, waiting=30), load(running=50, waiting=30)], 128) == 128
    assert c.observe([load(running=50, waiting=30), load(running=50, waiting=30)], 128) == 110
    # congestion: KV full or a retraction: multiplicative decrease
    assert c.observe([load(running=50, usage=0.95), load(running=50)], 110) == 82
    assert c.observe([load(running=50, retracted=2), load(running=50)], 82) == 61
    for _ in range(50):  # never below one group
        c.observe([load(retracted=1)], 0)
    assert c.limit == 4 == c.cap
    m = c.metrics()
    assert m["rollout/admission_limit"] == 4.0 and m["rollout/admission_increases"] == 1.0
    assert m["rollout/admission_decreases_queue"] == 1.0 and m["rollout/admission_decreases_congestion"] >= 2


def test_within_what_the_loads_allow_each_steps_speed_climbs_the_hill():
    """A step's own tokens/s judges probes of a neighbouring limit."""
    c = AdmissionControl("auto", 256, 4)
    c.observe([load(cap=128)], 0)
    speed = {128: 80.0, 102: 90.0, 82: 100.0, 66: 104.0, 53: 101.0, 42: 90.0}  # a peak at 66
    seen = []
    for _ in range(40):
        seen.append(c.limit)
        c.after_step(speed.get(c.limit, 50.0))
    # no room above the loads' cap (128): the first probe goes down; each win is followed by a probe further on
    assert seen[:20] == [128] * 4 + [102] * 4 + [82] * 4 + [66] * 4 + [53] * 4
    assert seen[20:34] == [66] * 4 + [82] * 4 + [66] * 6  # 53 lost, then 82 lost: both ways nothing, a rest
    assert seen[34:38] == [53] * 4 and c.climb.home == 66
    assert AdmissionControl("fixed", 64, 4).after_step(10.0) == 64


def test_the_climb_holds_where_the_steps_noise_hides_a_difference():
    """Step tokens/s vary 25% from step to step (a shared CPU box) around a flat optimum at the start."""
    rng = random.Random(0)
    c = AdmissionControl("auto", 256, 4, batch=64)
    c.observe([load(cap=128)], 0)
    curve = {64: 100.0, 80: 97.0, 51: 98.0}
    seen = []
    for _ in range(300):
        seen.append(c.limit)
        c.after_step(curve.get(c.limit, 85.0) * math.exp(rng.gauss(0.0, 0.25)))
    assert seen.count(64) / len(seen) > 0.8 and c.climb.home == 64 and c.climb.wins == 0
    # on a quiet box (2% noise) a neighbour 15% faster wins
    c = AdmissionControl("auto", 256, 4, batch=64)
    c.observe([load(cap=128)], 0)
    for _ in range(40):
        c.after_step({64: 100.0, 80: 115.0}.get(c.limit, 90.0) * math.exp(rng.gauss(0.0, 0.02)))
    assert c.climb.home == 80


def test_while_the_loads_cap_binds_the_climb_waits():
    c = AdmissionControl("auto", 256, 4, batch=64)
    c.observe([load(cap=128)], 0)
    c.observe([load(running=40, retracted=1)], 64)  # congestion: the cap goes to 48
    assert (c.limit, c.cap, c.climb.limit) == (48, 48, 64)
    for _ in range(10):
        c.after_step(100.0)
    assert c.limit == 48 and c.climb.probes == 0  # steps at the cap say nothing about the climb's limit
    for i in range(4):  # every slot in use, no queue: the cap grows back a group per report
        c.observe([load(running=48)], c.limit)
    assert (c.limit, c.cap) == (64, 64)
    c.observe([load(running=64)], 64)  # the climb's limit binds now; the loads would allow more
    assert (c.limit, c.cap) == (64, 68)


def test_auto_is_capped_by_the_pool_size_and_refuses_bad_input():
    assert AdmissionControl("auto", 32, 4).observe([load(cap=128)], 0) == 32
    with pytest.raises(ValueError, match="--admission"):
        AdmissionControl("sometimes", 32, 4)


def step_io(read, in_flight: int = 16):
    """A step's StepIO as LoadPoll sees it: its engines' `loads(session)`, its requester's requests in flight."""
    return SimpleNamespace(engines=SimpleNamespace(loads=lambda session: read()), session=None,
                           requester=SimpleNamespace(in_flight=in_flight))


def test_a_steps_load_poll_reads_reports_at_its_wakes_and_never_waits_on_one():
    """The step's loop hands the controller each report that came back at its next wake."""
    async def main():
        reply, calls = asyncio.Event(), []

        async def read():
            calls.append(1)
            await reply.wait()
            return [load(cap=32)]

        c = AdmissionControl("auto", 64, 4, batch=16, rule=AimdRule(interval_s=0.0))
        io = step_io(read)
        assert c.limit == 16 and not c.started  # one batch before the first report
        c.watch(io)  # a step starts: its engines are polled from its wakes on
        assert c.at_wake() == 16
        await asyncio.sleep(0)
        c.at_wake()  # the report is pending: no second one, nothing observed
        assert len(calls) == 1 and c.observations == 0
        reply.set()
        await c.poll.report
        c.at_wake()  # observed (the engines' capacity: 32 >= one batch), and the next report asked for
        await asyncio.sleep(0)
        assert c.started and c.observations == 1 and c.limit == 16 and len(calls) == 2
        c.step_ended(SimpleNamespace(target=None))  # a stream's segment: the poll ends, the limit stays
        assert c.poll is None and c.limit == 16

        slow = AdmissionControl("auto", 64, 4, batch=16, rule=AimdRule(interval_s=1e9))
        poll = LoadPoll(slow, io)
        poll.at_wake()
        await poll.report
        poll.at_wake()
        poll.at_wake()
        await asyncio.sleep(0)
        assert slow.observations == 1 and len(calls) == 3  # no new report within interval_s

        async def broken():
            raise ConnectionError("engine gone")

        poll = LoadPoll(c, step_io(broken))
        poll.at_wake()
        with pytest.raises(ConnectionError):
            await poll.report
        poll.at_wake()  # skipped: the limit holds
        assert c.observations == 1 and c.limit == 16 and poll.warned
        poll.close()
        fixed = AdmissionControl("fixed", 8, 4)
        fixed.watch(io)
        assert fixed.at_wake() == 8 and fixed.poll is None  # fixed asks the engines nothing

    asyncio.run(main())


KV_LIMITED = EngineCostModel(name="kv-limited", decode_base_s=0.01, decode_per_seq_s=0.0005, decode_per_token_s=0.0,
                             prefill_base_s=0.002, prefill_per_token_s=1e-5, max_running=256,
                             kv_capacity_tokens=48 * 1024)


def test_simulated_pool_finds_what_the_engine_can_run():
    """A pool whose ceiling is far above what the engine admits."""
    lengths = ParetoLengths(1.0, 8, 128)
    base = SimConfig(mode="pool", rollout_batch_size=16, n_samples_per_prompt=4, partial_rollout=True, pool_size=256,
                     max_response_len=1024, steps=8, warmup_steps=2, record_timeline=True)
    auto = simulate(base.replace(admission="auto"), KV_LIMITED, lengths)
    fixed = simulate(base, KV_LIMITED, lengths)
    peak_auto = max(n for _, n in auto.client_timeline[len(auto.client_timeline) // 2:])
    assert 40 <= peak_auto <= 80  # ~48 running plus the queue slack, not 256
    assert max(n for _, n in fixed.client_timeline) == 256
    for r in (auto, fixed):
        assert all(s["accepted"] == base.rollout_batch_size for s in r.steps)


@pytest.mark.slow
def test_auto_admission_learns_the_embedded_engines_capacity(tmp_path):
    """Pool mode against the embedded engine behind the real router, its batch capped at 4 rows."""
    from slime.arguments import parse_args
    from slime.backends.sglang_utils.engine_group import EngineGroup
    from slime.ray.buffer import PartialRolloutBuffer
    from slime.rollout.data_source import RolloutDataSource
    from slime.rollout.sglang_rollout import engine_rollout, generate_rollout
    from slime.tasks.subtract_chain import VOCAB, write_dataset
    from slime.utils.ledger import TRAINED
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    tok = build_tokenizer(VOCAB)
    build_tiny_qwen3(str(tmp_path / "model"), tok, TinyQwen3Spec(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        max_position_embeddings=256), seed=3)
    write_dataset(str(tmp_path / "prompts.jsonl"), 200, seed=0)
    args = parse_args([
        "--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "prompts.jsonl"),
        "--label-key", "label", "--rm-type", "subtract_chain", "--num-rollout", "4", "--rollout-backend", "embedded",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "64",
        "--rollout-ignore-eos", "--sglang-server-concurrency", "32", "--sglang-max-running-requests", "4",
        "--partial-rollout", "--rollout-mode", "pool", "--rollout-seed", "7", "--run-dir", str(tmp_path / "run")])
    assert (args.admission, args.rollout_pool_size) == ("auto", 32)
    source, buffer = RolloutDataSource(args, tok), PartialRolloutBuffer(args)
    with EngineGroup(args, log_dir=str(tmp_path / "logs")).start() as engines:
        rollout = engine_rollout(args, buffer, source, engines)  # the engines serve version 0
        control, outs = rollout.admission, []
        for step in range(4):
            outs.append(generate_rollout(args, step, rollout.context()))
            buffer.mark([g[0].group_index for g in outs[-1].groups], TRAINED)
    assert all(o.metrics["rollout/groups_accepted"] == 4 for o in outs)
    assert control.observations > 0 and control.started
    assert 2 <= control.limit <= 4 + 2 * 2  # what runs (4) plus a group or two of queue, not 32
    assert 2 <= outs[-1].metrics["rollout/admission_limit"] <= 4 + 2 * 2  # the limit the last step ran at
    assert outs[-1].metrics["rollout/in_flight_peak"] <= 4 + 3 * 2
    buffer.check_balanced()
