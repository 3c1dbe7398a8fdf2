"""RayTrainGroup: N trainer actors driven SPMD; every wait has a timeout and a failing rank is named
(`TrainerRankError`). With a `recover` hook (`--use-fault-tolerance`) a failed call is recovered and run again."""

from __future__ import annotations

import logging
import time
from typing import Callable

from slime.backends.training_utils.weight_sync.feed import feed_plan

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 3600.0


class TrainerRankError(RuntimeError):
    """A trainer rank failed a call; `recoverable` when a restart can help (it died or ran out of memory)."""

    def __init__(self, message: str, rank: int, died: bool, out_of_memory: bool = False):
        super().__init__(message)
        self.rank, self.died, self.recoverable = rank, died, died or out_of_memory


def _out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError (CUDA / HIP), Python's MemoryError, or a CPU allocator that could not allocate."""
    cause = getattr(error, "cause", None) or error  # a RayTaskError carries the rank's own exception
    text = str(cause).lower()
    return (type(cause).__name__ in ("OutOfMemoryError", "MemoryError") or "out of memory" in text
            or "can't allocate memory" in text)


def wait_ranks(refs: list, what: str, timeout: float, pids: list | None = None) -> list:
    """ray.get every rank's ref with one deadline; raise naming the first
    rank that failed (`TrainerRankError`, with its pid where known), or the ranks that did not answer in time."""
    import ray

    pending = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: trainer rank(s) {sorted(pending.values())} did not answer within {timeout:.0f}s")
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=left)
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref, timeout=max(1.0, left))
            except Exception as e:
                died = isinstance(e, ray.exceptions.RayActorError)
                pid = f" (pid {pids[rank]})" if pids and rank < len(pids) and pids[rank] else ""
                cause = str(e).strip().splitlines()[0] if died else str(e)
                raise TrainerRankError(f"{what}: trainer rank {rank}{pid} failed: "
                                       + (f"its process died ({type(e).__name__}: {cause})" if died else cause),
                                       rank, died, _out_of_memory(e)) from e
    return [results[r] for r in range(len(refs))]


def trainer_class(args):
    """The trainer of `--train-backend` (parse_args resolved `auto`)."""
    if args.train_backend == "fsdp":
        from slime.backends.fsdp_utils.actor import FSDPTrainer

        return FSDPTrainer
    if args.train_backend == "megatron":
        from slime.backends.megatron_utils.actor import MegatronTrainer

        return MegatronTrainer
    raise ValueError(f"--train-backend={args.train_backend!r}: expected 'fsdp' or 'megatron'")


class RayTrainGroup:
    def __init__(self, args, pg, recover: Callable[[TrainerRankError], None] | None = None):
        """`pg`: (placement group, bundle indices), a `PlacementGroups`, or a bare one. `recover(error)`: restarts
        the group after a rank dies or runs out of memory in a call, which then runs again (raise: give up)."""
        from slime.ray.placement_group import PlacementGroups

        self.args = args
        if isinstance(pg, PlacementGroups):
            pg, bundles = pg.actor
        elif isinstance(pg, tuple):
            pg, bundles = pg
        else:
            bundles = None
        n = args.actor_num_nodes * args.actor_num_gpus_per_node
        bundles = list(range(n)) if bundles is None else list(bundles)
        if len(bundles) != n:
            raise ValueError(f"RayTrainGroup: {n} trainer ranks (--actor-num-nodes × --actor-num-gpus-per-node) "
                             f"but {len(bundles)} placement-group bundles")
        self.world_size = n
        self.timeout = CALL_TIMEOUT_S
        self.recover = recover
        self._pg, self._bundles = pg, bundles
        self.actors = self._spawn()
        self._closed = False
        self.info: dict = {}
        self.rank_devices: list[int | None] = []
        self.pids: list[int | None] = []

    def _spawn(self) -> list:
        """One trainer actor per rank, each on its bundle."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from slime.ray.placement_group import TRAINER_GPU_SHARE, ray_has_gpus

        args = self.args
        use_gpu = ray_has_gpus()
        gpus = (TRAINER_GPU_SHARE if args.colocate else 1.0) if use_gpu else 0
        cls = ray.remote(trainer_class(args))
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        if args.train_backend == "megatron":
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # megatron: TP / sequence-parallel comms keep kernel order
        return [
            cls.options(
                num_cpus=0.5 if use_gpu else 1,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg,
                                                                     placement_group_bundle_index=b),
                runtime_env={"env_vars": env},
            ).remote(args, rank, self.world_size)
            for rank, b in enumerate(self._bundles)
        ]

    def _all(self, method: str, *a, timeout: float | None = None, **kw) -> list:
        while True:
            refs = [getattr(actor, method).remote(*a, **kw) for actor in self.actors]
            try:
                return wait_ranks(refs, f"trainer.{method}", timeout or self.timeout, self.pids)
            except TrainerRankError as e:
                if self.recover is None or method in ("init", "shutdown") or not e.recoverable:
                    raise
                self.recover(e)  # raises to give up; else the group is back where it was: the call runs again

    def restart(self) -> None:
        """Every rank anew on its bundle (the live ones are killed: their collectives broke with the dead one),
        set up as `init` does, with the weights of --hf-checkpoint; the caller loads and replays what it needs."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = self._spawn()
        self.init()

    # ---------------------------------------------------------- contract ----
    def init(self) -> "RayTrainGroup":
        """Start the process group and load the model on every rank; returns self (`.info`: rank 0's report)."""
        import ray

        addr, port = ray.get(self.actors[0].open_master_port.remote(), timeout=INIT_TIMEOUT_S)
        self.pids = [None] * self.world_size
        out = self._all("init", addr, port, timeout=INIT_TIMEOUT_S)
        self.info = out[0]
        self.rank_devices = [o["device_index"] for o in out]  # node GPU of each rank (None on CPU)
        self.pids = [n["pid"] for n in self.nodes()]
        logger.info("%d trainer rank(s) ready (%s params; pids %s)", self.world_size, self.info.get("num_params"),
                    self.pids)
        return self

    def nodes(self, timeout: float = 60.0) -> list[dict]:
        """Per rank: node_id, node_ip, hostname, pid and the code root its actor imports."""
        from slime.utils.run import process_placement

        return wait_ranks([a.__ray_call__.remote(process_placement) for a in self.actors], "trainer.nodes", timeout)

    def train(self, rollout_id: int, groups, policy_version: int = 0) -> dict[str, float]:
        """Every rank gets every group (it plans its split); returns rank 0's metrics, reduced across ranks."""
        import ray

        ref = groups if isinstance(groups, ray.ObjectRef) else ray.put(groups)
        return self._all("train", rollout_id, ref, policy_version)[0]

    def update_weights(self, engines, new_version: int, flush_cache: bool = True) -> dict[str, float]:
        """Push weights to every engine worker as `new_version` (engines: an EngineGroup or a list of worker URLs),
        idle or paused by the caller (the run's Rollout, slime/rollout/rollout.py, which also says `flush_cache`)."""
        is_group = not isinstance(engines, (list, tuple))
        feeds = None
        if self.args.update_weight_mode == "tensor":  # by reference: each engine from the ranks on its devices
            urls = list(engines.engine_urls) if is_group else list(engines)
            feeds = feed_plan(urls, self.args.rollout_num_gpus_per_engine, self.rank_devices,
                              engines.engine_devices() if is_group else None)
        else:
            urls = list(engines.worker_urls()) if is_group else list(engines)
        return self._all("update_weights", urls, int(new_version), feeds, flush_cache)[0]

    def save(self, path: str) -> None:
        self._all("save", path)

    def load(self, path: str) -> None:
        self._all("load", path)

    def export_hf(self, path: str) -> None:
        self._all("export_hf", path)

    def offload(self) -> dict[str, float]:
        """--offload: every rank's parameters, gradients and optimizer state leave its device; rank 0's report."""
        return self._all("offload")[0]

    def onload(self) -> dict[str, float]:
        return self._all("onload")[0]

    def shutdown(self, timeout: float = 60.0) -> None:
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            self._all("shutdown", timeout=timeout)
        except Exception as e:
            logger.warning("trainer shutdown: %s", e)
        for actor in self.actors:
            ray.kill(actor)
