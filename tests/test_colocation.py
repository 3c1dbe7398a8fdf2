"""The colocated step's phases and the trainer-rank -> engine feed plan."""

from __future__ import annotations

import pytest

from slime.backends.training_utils.weight_sync.feed import EngineFeed, feed_plan
from slime.ray.colocation import ColocatedPhases, Phases, device_phases


class Recorder:
    """Answers as RayTrainGroup (offload / onload) and EngineGroup (release / resume) do, counting bytes per tag."""

    def __init__(self, log: list, who: str):
        self.log, self.who = log, who
        self.held = {"weights": 100, "kv_cache": 40, "cuda_graph": 0}

    def offload(self):
        self.log.append(f"{self.who}.offload")
        return {"offload_bytes": 10.0, "reserved_before": 30.0, "reserved_after": 2.0}

    def onload(self):
        self.log.append(f"{self.who}.onload")
        return {"onload_bytes": 10.0}

    def release_memory_occupation(self, tags):
        self.log.append(f"{self.who}.release {','.join(tags)}")
        for t in tags:
            self.held[t] = 0

    def resume_memory_occupation(self, tags):
        self.log.append(f"{self.who}.resume {','.join(tags)}")
        if "weights" in tags:
            self.held["weights"] = 100

    def memory(self):
        return {"held": sum(self.held.values()), "device_free": 1000 - sum(self.held.values())}


def run_steps(phases, log, steps=2):
    for _ in range(steps):
        with phases.rollout():
            log.append("generate")
        with phases.train():
            log.append("train")
        with phases.weight_sync():
            log.append("sync")
        log.append("eval")
        yield phases.metrics()


def test_colocated_step_hands_the_devices_over_in_slimes_order():
    log: list[str] = []
    engines = Recorder(log, "engines")
    phases = ColocatedPhases(Recorder(log, "trainer"), engines, offload=True, engine_memory=engines.memory)
    metrics = list(run_steps(phases, log))
    one_step = ["engines.release weights,kv_cache,cuda_graph", "trainer.onload", "train", "engines.resume weights",
                "sync", "trainer.offload", "engines.resume kv_cache,cuda_graph", "eval"]
    assert log == ["trainer.offload", "generate", *one_step, "generate", *one_step]
    m = metrics[1]
    # the time split of one step: the phases' bodies and every hand-over
    assert {"perf/rollout_s", "perf/train_s", "perf/weight_push_s", "colocate/engine_release_s",
            "colocate/engine_resume_s", "colocate/trainer_onload_s", "colocate/trainer_offload_s"} <= set(m)
    # memory handed back each way: the trainer's bytes, the engines' own count, the device's free memory
    assert m["colocate/trainer_offload_bytes"] == m["colocate/trainer_onload_bytes"] == 10.0
    assert m["colocate/trainer_device_freed_bytes"] == 28.0
    assert m["colocate/engine_resume_bytes"] == 100  # the weights; the KV cache comes back empty
    # (these fakes never regrow it: the second release frees the weights alone; the first, what the engines held)
    assert m["colocate/engine_release_bytes"] == m["colocate/engine_device_freed_bytes"] == 100
    assert metrics[0]["colocate/engine_release_bytes"] == metrics[0]["colocate/engine_device_freed_bytes"] == 140


def test_engine_memory_that_cannot_be_read_leaves_the_bytes_out_and_the_step_runs():
    log: list[str] = []

    def broken():
        raise ConnectionError("engine gone")

    phases = ColocatedPhases(Recorder(log, "trainer"), Recorder(log, "engines"), offload=True, engine_memory=broken)
    m = list(run_steps(phases, log, 1))[0]
    assert "colocate/engine_release_s" in m and not any(k.startswith("colocate/engine_") and k.endswith("_bytes")
                                                        for k in m)


def test_colocated_without_offload_and_debug_modes():
    log: list[str] = []
    list(run_steps(ColocatedPhases(Recorder(log, "trainer"), Recorder(log, "engines"), offload=False), log, 1))
    assert not any(x.startswith("trainer.") for x in log) and "engines.release weights,kv_cache,cuda_graph" in log
    log.clear()
    list(run_steps(ColocatedPhases(None, Recorder(log, "engines"), offload=True), log, 1))  # --debug-rollout-only
    assert "trainer.offload" not in log
    log.clear()
    list(run_steps(ColocatedPhases(Recorder(log, "trainer"), None, offload=True), log, 1))  # --debug-train-only
    assert log == ["trainer.offload", "generate", "trainer.onload", "train", "sync", "trainer.offload", "eval"]


def test_disaggregated_phases_move_nothing(base_args):
    log: list[str] = []
    phases = device_phases(base_args, Recorder(log, "trainer"), Recorder(log, "engines"))
    assert type(phases) is Phases
    m = list(run_steps(phases, log, 1))[0]
    assert log == ["generate", "train", "sync", "eval"]
    assert set(m) == {"perf/rollout_s", "perf/train_s", "perf/weight_push_s"}  # the split, no hand-over
    colo = device_phases(base_args.replace(colocate=True, offload=True), Recorder(log, "t"), Recorder(log, "e"))
    assert isinstance(colo, ColocatedPhases) and colo.offload


def test_feed_plan_matches_each_engine_tp_rank_with_the_trainer_on_its_gpu():
    urls = ["http://e0", "http://e1"]
    # Ray placed the 4 trainer ranks on GPUs 2, 0, 3, 1; engine e's TP rank j is on GPU 2e + j
    plan = feed_plan(urls, 2, [2, 0, 3, 1])
    assert plan == [EngineFeed("http://e0", (1, 3)), EngineFeed("http://e1", (0, 2))]
    assert [f.leader for f in plan] == [1, 0]
    assert feed_plan(urls, 1, [0, 1]) == [EngineFeed("http://e0", (0,)), EngineFeed("http://e1", (1,))]
    # placed engines: their bundles' GPUs (Ray's ids on the node), whatever their rank
    assert feed_plan(urls, 1, [4, 5], [(5,), (4,)]) == [EngineFeed("http://e0", (1,)), EngineFeed("http://e1", (0,))]
    assert feed_plan(urls, 1, [0, 1], [None, None]) == feed_plan(urls, 1, [0, 1])
    with pytest.raises(ValueError, match=r"engine 1 \(http://e1\) runs on GPUs \[7\]"):
        feed_plan(urls, 1, [4, 5], [(5,), (7,)])
    # CPU: shared memory reaches every engine from rank 0
    assert feed_plan(urls, 2, [None, None]) == [EngineFeed("http://e0", (0,)), EngineFeed("http://e1", (0,))]
    with pytest.raises(ValueError, match=r"engine 1 .* no trainer rank is on GPU\(s\) \[3\]"):
        feed_plan(urls, 2, [0, 1, 2])
