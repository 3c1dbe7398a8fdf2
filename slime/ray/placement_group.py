"""Placement groups shaped by the hardware (GPU bundles only where Ray sees GPUs; colocated runs share each
bundle), located, each node's files checked there; `engine_slots()` hands each engine its bundles."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from slime.backends.sglang_utils.engine_host import HOST_NUM_GPUS, EngineSlot
from slime.utils.paths import SHARED_STORAGE_HINT, PathNotVisibleError, path_problems, shared_marker

logger = logging.getLogger(__name__)

PG_READY_TIMEOUT_S = 60.0
PROBE_TIMEOUT_S = 120.0
CPUS_PER_BUNDLE = 1.0
PROBE_GPUS = 0.01  # a probe task's share of its bundle's GPU: enough for Ray to say which GPU it is
# --colocate: each GPU bundle is time-shared (fractional GPUs, as slime does) by a trainer rank and an engine
TRAINER_GPU_SHARE = 0.4
ENGINE_GPU_SHARE = HOST_NUM_GPUS
assert TRAINER_GPU_SHARE + ENGINE_GPU_SHARE + PROBE_GPUS <= 1.0


class PlacementError(RuntimeError):
    """The cluster cannot hold the run's bundles; the message names what was asked for and what the cluster has."""


def ray_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


@dataclass(frozen=True)
class BundleInfo:
    index: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()


@dataclass
class PlacementGroups:
    pg: object  # ray PlacementGroup
    actor_bundles: list[int]
    rollout_bundles: list[int]
    use_gpu: bool
    bundles: dict[int, BundleInfo] = field(default_factory=dict)
    driver_node_id: str | None = None

    @property
    def actor(self) -> tuple[object, list[int]]:
        return self.pg, self.actor_bundles

    @property
    def rollout(self) -> tuple[object, list[int]]:
        return self.pg, self.rollout_bundles

    @property
    def node_ips(self) -> list[str]:
        return sorted({b.node_ip for b in self.bundles.values()})

    def engine_slots(self, num_engines: int, gpus_per_engine: int) -> list[EngineSlot]:
        """Engine i takes rollout bundles [i*k, (i+1)*k) on one node; its host actor goes to the first."""
        per = gpus_per_engine if self.use_gpu else 1
        if len(self.rollout_bundles) < num_engines * per:
            raise PlacementError(f"{num_engines} engine(s) of {per} bundle(s) need {num_engines * per} rollout bundles, "
                                 f"the placement group has {len(self.rollout_bundles)}")
        slots = []
        for rank in range(num_engines):
            infos = [self.bundles[b] for b in self.rollout_bundles[rank * per:(rank + 1) * per]]
            nodes = {b.node_id for b in infos}
            if len(nodes) != 1:
                raise PlacementError(f"engine {rank} needs its {per} GPUs on one node (--rollout-num-gpus-per-engine "
                                     f"{gpus_per_engine}), but its bundles landed on "
                                     + ", ".join(f"bundle {b.index} on {b.node_ip}" for b in infos)
                                     + "; give each node a multiple of --rollout-num-gpus-per-engine rollout GPUs")
            slots.append(EngineSlot(self.pg, tuple(b.index for b in infos), infos[0].node_id, infos[0].node_ip,
                                    tuple(g for b in infos for g in b.gpu_ids)))
        return slots


def bundle_plan(args, use_gpu: bool) -> tuple[list[dict], list[int], list[int]]:
    """(bundles, trainer bundle indices, rollout bundle indices) from the flags."""
    n_actor = args.actor_num_nodes * args.actor_num_gpus_per_node
    colocate = args.colocate
    n_rollout = 0 if colocate else args.rollout_num_gpus
    bundle = {"GPU": 1, "CPU": CPUS_PER_BUNDLE} if use_gpu else {"CPU": CPUS_PER_BUNDLE}
    bundles = [dict(bundle) for _ in range(n_actor + n_rollout)]
    actor_idx = list(range(n_actor))
    rollout_idx = actor_idx if colocate else list(range(n_actor, n_actor + n_rollout))
    return bundles, actor_idx, rollout_idx


# --- what the cluster has --------------------------------------------------------------------
def _fmt(resources: dict) -> str:
    keys = [k for k in ("CPU", "GPU") if k in resources] or sorted(resources)
    return "{" + ", ".join(f"{k}: {float(resources.get(k, 0)):g}" for k in keys) + "}"


def cluster_report() -> str:
    """Every alive node with its CPUs and GPUs (free / total) as Ray sees them now."""
    import ray

    avail = {}
    try:
        from ray._private.state import available_resources_per_node  # a DeveloperAPI: free resources per node

        avail = available_resources_per_node()
    except Exception:  # noqa: BLE001 - totals only then
        pass
    lines = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        total, free = n.get("Resources", {}), avail.get(n["NodeID"])
        parts = []
        for k in ("CPU", "GPU"):
            t = float(total.get(k, 0))
            parts.append(f"{k} {float(free.get(k, 0)):g}/{t:g} free" if free is not None else f"{k} {t:g}")
        lines.append(f"node {n['NodeManagerAddress']} ({n['NodeID'][:8]}): " + ", ".join(parts))
    return "; ".join(lines) or "no alive node"


def _asked(args, bundles: list[dict], actor_idx: list[int], rollout_idx: list[int]) -> str:
    n_rollout = 0 if args.colocate else len(rollout_idx)
    shape = _fmt(bundles[0]) if bundles else "{}"
    total = {k: sum(float(b.get(k, 0)) for b in bundles) for k in bundles[0]} if bundles else {}
    return (f"{len(actor_idx)} trainer + {n_rollout} rollout bundle(s) of {shape}"
            f"{' (colocated)' if args.colocate else ''} = {_fmt(total)}")


def create_placement_groups(args, timeout_s: float = PG_READY_TIMEOUT_S) -> PlacementGroups:
    """The run's placement group, ready, its bundles located and sorted, and each node's files checked; raises
    PlacementError naming what was asked for and what the cluster has, PathNotVisibleError naming the node."""
    import ray
    from ray.util.placement_group import placement_group

    use_gpu = ray_has_gpus()
    bundles, actor_idx, rollout_idx = bundle_plan(args, use_gpu)
    have = ray.cluster_resources()
    short = [k for k in bundles[0] if sum(b[k] for b in bundles) > float(have.get(k, 0))]
    if short:
        raise PlacementError(
            f"placement group asks for {_asked(args, bundles, actor_idx, rollout_idx)} but the cluster has "
            f"{_fmt({k: have.get(k, 0) for k in bundles[0]})} ({cluster_report()}); add nodes (or start Ray with "
            f"more num_cpus) or lower --actor-num-nodes / --actor-num-gpus-per-node / --rollout-num-gpus")
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise PlacementError(f"placement group not ready after {timeout_s:.0f}s: it asks for "
                             f"{_asked(args, bundles, actor_idx, rollout_idx)}; the cluster has {cluster_report()} "
                             f"(other jobs may hold the rest)")
    try:
        pgs = _locate(args, pg, actor_idx, rollout_idx, use_gpu)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    logger.info("placement group: %d trainer + %d rollout bundles (%s, colocate=%s) on %s", len(actor_idx),
                len(rollout_idx), "GPU" if use_gpu else "CPU", args.colocate, ", ".join(pgs.node_ips))
    return pgs


def _probe(checks: list[tuple[str, str, str]]) -> dict:
    """Runs inside a bundle: where it is, which GPUs Ray gave it, and what of `checks` this node cannot see."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "problems": path_problems(checks)}


def _node_checks(args, role: str, marker: str | None) -> list[tuple[str, str, str]]:
    checks = [("--hf-checkpoint", args.hf_checkpoint, "hf_dir")]
    if role == "trainer":
        if args.ref_load:
            checks.append(("--ref-load", args.ref_load, "dir"))
        if args.load and os.path.isdir(args.load):
            checks.append(("--load", args.load, "dir"))
        if args.save and marker:
            checks.append(("--save", args.save, f"shared:{marker}"))
    return checks


def _locate(args, pg, actor_idx: list[int], rollout_idx: list[int], use_gpu: bool) -> PlacementGroups:
    """Node and GPUs of every bundle; path checks on every node but the driver's (it checked them itself)."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    driver_node = ray.get_runtime_context().get_node_id()
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    node_of = {int(i): nid for i, nid in placement_group_table(pg)["bundles_to_node_id"].items()}
    trainer_bundles = set(actor_idx) if not args.debug_rollout_only else set()
    rollout_bundles = set(rollout_idx) if not args.debug_train_only else set()
    probe = ray.remote(_probe)
    with _maybe_marker(args.save if trainer_bundles else None) as marker:
        refs, seen_nodes = {}, set()
        for b in sorted(set(actor_idx) | set(rollout_idx)):
            remote_node = node_of[b] != driver_node
            role = "trainer" if b in trainer_bundles else "rollout" if b in rollout_bundles else None
            check_here = remote_node and role is not None and (node_of[b], role) not in seen_nodes
            if not (use_gpu or check_here):
                continue
            seen_nodes.add((node_of[b], role))
            checks = _node_checks(args, role, marker) if check_here else []
            refs[b] = probe.options(num_cpus=0, num_gpus=PROBE_GPUS if use_gpu else 0,
                                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                                        placement_group=pg, placement_group_bundle_index=b)).remote(checks)
        found = dict(zip(refs, ray.get(list(refs.values()), timeout=PROBE_TIMEOUT_S))) if refs else {}
    problems = [f"node {r['node_ip']} (bundle {b}, {'trainer' if b in trainer_bundles else 'rollout'}): "
                + "; ".join(r["problems"]) for b, r in found.items() if r["problems"]]
    if problems:
        raise PathNotVisibleError(" | ".join(problems) + f" ({SHARED_STORAGE_HINT})")
    infos = {}
    for b in set(actor_idx) | set(rollout_idx):
        got = found.get(b)
        infos[b] = BundleInfo(b, node_of[b], ips.get(node_of[b], "?"), tuple(got["gpu_ids"]) if got else ())

    def order(b: int):
        info = infos[b]
        return (info.node_ip, info.node_id, tuple(int(g) if g.isdigit() else -1 for g in info.gpu_ids), b)

    actor_sorted = sorted(actor_idx, key=order)
    rollout_sorted = actor_sorted if args.colocate else sorted(rollout_idx, key=order)
    return PlacementGroups(pg, actor_sorted, rollout_sorted, use_gpu, infos, driver_node)


class _maybe_marker:
    """A shared_marker in `directory` when given (and a directory), else nothing."""

    def __init__(self, directory: str | None):
        self._inner = shared_marker(directory) if directory and os.path.isdir(directory) else None

    def __enter__(self) -> str | None:
        return self._inner.__enter__() if self._inner is not None else None

    def __exit__(self, *exc) -> None:
        if self._inner is not None:
            self._inner.__exit__(*exc)


def write_placement(run_dir: str, pgs: PlacementGroups, trainers=None, engines=None) -> dict:
    """RUN_DIR/placement.json: where the driver, every trainer rank and every engine run (node id and IP, the
    code each imports) and each bundle's node and GPUs; logged in one line."""
    from slime.utils.run import process_placement

    placement = {
        "driver": process_placement(),
        "bundles": {str(b): {"node_id": i.node_id, "node_ip": i.node_ip, "gpu_ids": list(i.gpu_ids)}
                    for b, i in sorted(pgs.bundles.items())},
        "trainer_bundles": pgs.actor_bundles, "rollout_bundles": pgs.rollout_bundles,
        "trainers": trainers.nodes() if trainers is not None else [],
        "engines": engines.engine_nodes() if engines is not None else [],
    }
    with open(os.path.join(run_dir, "placement.json"), "w") as f:
        json.dump(placement, f, indent=1)
    def where(items):
        return ", ".join(f"{i}@{x['node_ip']}/{(x['node_id'] or '?')[:8]}" for i, x in enumerate(items)) or "-"

    logger.info("placement: driver@%s; trainer ranks %s; engines %s", where([placement["driver"]])[2:],
                where(placement["trainers"]), where(placement["engines"]))
    return placement


def remove_placement_groups(pgs: PlacementGroups) -> None:
    import ray

    ray.util.remove_placement_group(pgs.pg)
