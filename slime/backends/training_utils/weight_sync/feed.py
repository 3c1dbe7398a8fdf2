"""Which trainer ranks feed which engine for `--update-weight-mode tensor`: on GPUs, the trainer rank on each of an
engine's TP GPUs (its placement-group bundles, or `e * k + j` for an engine launched outside Ray) hands over CUDA
IPC handles, and the engine's first trainer rank posts them in TP order; on CPU trainer rank 0 feeds every engine.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineFeed:
    url: str
    ranks: tuple[int, ...]  # the trainer rank on each TP rank's device, in TP order; ranks[0] posts

    @property
    def leader(self) -> int:
        return self.ranks[0]


def feed_plan(engine_urls: list[str], gpus_per_engine: int, rank_devices: list[int | None] | None,
              engine_devices: list[tuple[int, ...] | None] | None = None) -> list[EngineFeed]:
    """One feed per engine (in engine-rank order). `rank_devices`: each trainer rank's node GPU index, or None
    (CPU: rank 0 feeds all). `engine_devices`: each engine's node GPU indices in TP order where its bundles
    say (EngineGroup.engine_devices()); None (or a None entry): GPUs e * k + j."""
    if not engine_urls:
        raise ValueError("tensor weight sync: no engine URLs")
    if not rank_devices or any(d is None for d in rank_devices):
        return [EngineFeed(url, (0,)) for url in engine_urls]
    on_device = {d: r for r, d in enumerate(rank_devices)}
    plan = []
    for e, url in enumerate(engine_urls):
        placed = engine_devices[e] if engine_devices is not None else None
        devices = list(placed) if placed is not None else [e * gpus_per_engine + j for j in range(gpus_per_engine)]
        missing = [d for d in devices if d not in on_device]
        if missing:
            raise ValueError(f"engine {e} ({url}) runs on GPUs {devices} but no trainer rank is on GPU(s) {missing} "
                             f"(trainer ranks are on {rank_devices}); --colocate needs one trainer rank per engine GPU")
        plan.append(EngineFeed(url, tuple(on_device[d] for d in devices)))
    return plan
