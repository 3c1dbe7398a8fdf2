"""The quick start on a 3-node Ray cluster, joined through RAY_ADDRESS."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    where = tmp_path_factory.mktemp("cluster_home")
    saved_cwd, saved_path = os.getcwd(), os.environ.pop("PYTHONPATH", None)
    os.chdir(where)  # the cluster's processes (and so its workers) do not start in the repo
    try:
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        c.add_node(num_cpus=1)
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
    finally:
        os.chdir(saved_cwd)
        if saved_path is not None:
            os.environ["PYTHONPATH"] = saved_path
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.5)
    return alive


def test_quickstart_on_a_three_node_cluster_places_trainer_and_engine_on_different_nodes(cluster, tmp_path, quickstart_task):
    import ray
    from ray._private.state import actors  # the GCS actor table (Ray's state API without a dashboard)

    run = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "SLIME_SKIP_INSTALL": "1", "STEPS": str(STEPS),
           "EVAL_INTERVAL": "1000", "RUN": str(run), "SIMULATE": "0", "PYTHONUNBUFFERED": "1"}
    # relative paths from the repo (the quick start's WORK=runs/tiny): the cluster's workers run elsewhere
    out = subprocess.run(["bash", "scripts/quickstart.sh", "--no-partial", "--skip-eval-before-train"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert f"joined the Ray cluster at {cluster.address} (3 node(s))" in out.stderr

    placement = json.loads((run / "placement.json").read_text())
    trainers, engines = placement["trainers"], placement["engines"]
    assert len(trainers) == 1 and len(engines) == 1
    # every process of the run imports this checkout, though the cluster's workers have no PYTHONPATH of their own
    assert {p["code_root"] for p in [placement["driver"], *trainers, *engines]} == {REPO}

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        table = list(actors().values())
        nodes = {n["NodeID"]: n for n in ray.nodes()}
    finally:
        ray.shutdown()
    cluster_nodes = {n.node_id for n in cluster.list_all_nodes()}
    trainer_nodes = {a["Address"]["NodeID"] for a in table if a["ActorClassName"] == "FSDPTrainer"}
    engine_nodes = {a["Address"]["NodeID"] for a in table if a["ActorClassName"] == "EngineHost"}
    assert len(trainer_nodes) == 1 and len(engine_nodes) == 1
    assert trainer_nodes != engine_nodes and (trainer_nodes | engine_nodes) <= cluster_nodes
    assert trainer_nodes == {trainers[0]["node_id"]} and engine_nodes == {engines[0]["node_id"]}
    # the run's actors ended with it; the cluster's three nodes are still up
    assert not [a for a in table if a["State"] == "ALIVE" and a["ActorClassName"] in
                ("FSDPTrainer", "EngineHost", "PartialRolloutBuffer")]
    assert sum(1 for n in nodes.values() if n["Alive"]) == 3

    # the run's processes are gone: driver-side router included (its port answered nothing after the run)
    pids = [placement["driver"]["pid"], trainers[0]["pid"], engines[0]["pid"], engines[0]["server_pid"]]
    assert _wait_gone(pids) == []
    assert cluster.remaining_processes_alive()  # the cluster's own processes stay

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert summary["off_policy_token_ratio"] == 0.0  # synchronous: every token from the policy it trains
    assert "==== run summary ====" in out.stderr
    assert os.path.isdir(run / "ckpt" / f"iter_{STEPS - 1:07d}")
    for name in ("reward", "throughput", "off_policy", "lengths", "occupancy"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 5_000, name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "weight_sync/weight_sync_tensor" in r]
    # every update went over the broadcast group (SGLang's layout and session), across nodes
    assert len(steps) == STEPS and all(r["weight_sync/weight_sync_tensor"] == 0.0
                                       and r["weight_sync/weight_sync_from_disk"] == 0.0 for r in steps)
