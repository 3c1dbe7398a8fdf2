"""Weight-update group calls fanned out to every engine, returning futures so the
trainer can broadcast tensors while the engines are waiting in their receive.

Sequence (trainer side, see slime/backends/fsdp_utils/):
    futs = engines.init_weights_update_group(addr, port)      # engines join the group...
    <trainer joins the group as rank 0>                        # ...while the trainer joins it, in SGLang's
                                                               # layout (slime.utils.weight_update_group.join)
    engines.wait_all(futs, "init_weights_update_group", check_success=True)
    sessions = engines.begin_weight_update()                   # SGLang >= 0.5.21 refuses updates without one
    futs = engines.update_weights_from_distributed(names, dtypes, shapes, version)
    <trainer broadcasts each tensor in `names` order from rank 0>
    engines.wait_all(futs, "update_weights_from_distributed", check_success=True)
    sessions.close()                                           # /end_weight_update
    engines.wait_all(engines.destroy_weights_update_group(), "destroy", check_success=True)

Engine i (in `worker_urls()` order) gets rank_offset 1 + i * tp; the group's
world size is 1 + num_workers * tp (`weight_update_world_size()`).
"""

from __future__ import annotations

from concurrent.futures import Future

from slime.backends.sglang_utils.weight_session import WeightUpdateSessions

DEFAULT_GROUP_NAME = "weight_update_group"


class WeightUpdateMixin:
    """Needs `worker_urls()`, `_submit_all(...)`, `_pool`, `num_gpus_per_engine` and `backend` from EngineGroup."""

    def weight_update_world_size(self) -> int:
        return 1 + len(self.worker_urls()) * self.num_gpus_per_engine

    def default_weight_update_backend(self) -> str:
        return "nccl" if self.backend == "sglang" else "gloo"

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  group_name: str = DEFAULT_GROUP_NAME, backend: str | None = None,
                                  timeout: float = 600.0) -> dict[str, Future]:
        """POST /init_weights_update_group to every worker concurrently; returns {url: Future}."""
        urls = self.worker_urls()
        tp = self.num_gpus_per_engine
        world_size = 1 + len(urls) * tp
        payloads = [{
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": 1 + i * tp,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend or self.default_weight_update_backend(),
        } for i in range(len(urls))]
        return self._submit_all("POST", "/init_weights_update_group", timeout=timeout, urls=urls, payloads=payloads)

    def begin_weight_update(self, timeout: float = 120.0) -> WeightUpdateSessions:
        """Open SGLang's weight-update session on every worker (none where the server has no sessions); close it
        with `.close()` on the returned object after the last bucket."""
        sessions = WeightUpdateSessions(self._pool, timeout)
        sessions.open(self.worker_urls())
        return sessions

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        weight_version: int, group_name: str = DEFAULT_GROUP_NAME,
                                        flush_cache: bool = True, load_format: str | None = None,
                                        timeout: float = 600.0) -> dict[str, Future]:
        """POST /update_weights_from_distributed to every worker concurrently; returns {url: Future}.

        The engines then wait for the trainer to broadcast the tensors in `names` order.
        """
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"update_weights_from_distributed: names/dtypes/shapes lengths differ "
                             f"({len(names)}/{len(dtypes)}/{len(shapes)})")
        payload = {
            "names": list(names),
            "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": str(int(weight_version)),
        }
        if load_format is not None:
            payload["load_format"] = load_format
        return self._submit_all("POST", "/update_weights_from_distributed", payload, timeout=timeout)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME,
                                     timeout: float = 120.0) -> dict[str, Future]:
        return self._submit_all("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)
