"""Ray start-up and placement groups shaped by the hardware.

One placement group holds ``actor_num_nodes × actor_num_gpus_per_node``
trainer bundles, plus ``rollout_num_gpus`` rollout bundles when the run is
not colocated. Bundles ask for a GPU only where Ray sees GPUs: a GPU bundle
on a CPU-only machine would wait forever without an error. Colocated runs
give the rollout the trainer's bundles: one bundle per GPU, shared by a
trainer rank (TRAINER_GPU_SHARE) and an engine TP rank; an engine with
``--rollout-num-gpus-per-engine`` k spans k consecutive bundles (on CPU
they simply share the cores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PG_READY_TIMEOUT_S = 60.0
CPUS_PER_BUNDLE = 1.0
# --colocate: each GPU bundle is time-shared (fractional GPUs, as slime does): a trainer rank takes this share
# and the engine TP rank on the same GPU the rest (engines are launched by the driver on GPU e * tp + j today;
# placing them as Ray actors on their bundles, with ENGINE_GPU_SHARE, is the next step)
TRAINER_GPU_SHARE = 0.4
ENGINE_GPU_SHARE = 0.2


def ray_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


@dataclass
class PlacementGroups:
    pg: object  # ray PlacementGroup
    actor_bundles: list[int]
    rollout_bundles: list[int]
    use_gpu: bool

    @property
    def actor(self) -> tuple[object, list[int]]:
        return self.pg, self.actor_bundles

    @property
    def rollout(self) -> tuple[object, list[int]]:
        return self.pg, self.rollout_bundles


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


def create_placement_groups(args, timeout_s: float = PG_READY_TIMEOUT_S) -> PlacementGroups:
    import ray
    from ray.util.placement_group import placement_group

    use_gpu = ray_has_gpus()
    bundles, actor_idx, rollout_idx = bundle_plan(args, use_gpu)
    need_cpu = sum(b["CPU"] for b in bundles)
    have_cpu = float(ray.cluster_resources().get("CPU", 0))
    if need_cpu > have_cpu:
        raise RuntimeError(
            f"placement group needs {need_cpu:g} CPUs ({len(actor_idx)} trainer + "
            f"{0 if args.colocate else len(rollout_idx)} rollout bundles) but Ray has {have_cpu:g}; "
            f"start Ray with more num_cpus or lower --actor-num-gpus-per-node / --rollout-num-gpus"
        )
    pg = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(f"placement group {bundles} not ready after {timeout_s:.0f}s (resources: "
                           f"{ray.available_resources()})")
    logger.info("placement group: %d trainer + %d rollout bundles (%s, colocate=%s)", len(actor_idx),
                len(rollout_idx), "GPU" if use_gpu else "CPU", args.colocate)
    return PlacementGroups(pg, actor_idx, rollout_idx, use_gpu)


def remove_placement_groups(pgs: PlacementGroups) -> None:
    import ray

    ray.util.remove_placement_group(pgs.pg)
