"""The trainer's weight push as the engines see it: calls fanned out to every worker, returning futures so the
trainer can broadcast tensors while the engines wait in their receive.

Sequence (trainer side, see slime/backends/training_utils/weight_sync/):
    futs = push.init_group(addr, port)                     # engines join the group...
    <trainer joins the group as rank 0>                    # ...while the trainer joins it, in SGLang's layout
                                                           # (slime.utils.weight_update_group.join)
    push.wait(futs, "init_weights_update_group", check_success=True)
    sessions = push.begin()                                # SGLang >= 0.5.21 refuses updates without one
    futs = push.from_distributed(names, dtypes, shapes, version)
    <trainer broadcasts each tensor in `names` order from rank 0>
    push.wait(futs, "update_weights_from_distributed", check_success=True)
    sessions.close()                                       # /end_weight_update
    push.wait(push.destroy_group(), "destroy", check_success=True)

Engine i (in `worker_urls()` order) gets rank_offset 1 + i * tp; the group's world size is 1 + num_workers * tp.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from slime.backends.sglang_utils.fan_out import FanOut
from slime.backends.sglang_utils.weight_session import WeightUpdateSessions

DEFAULT_GROUP_NAME = "weight_update_group"


class WeightPush:
    """`fan_out` reaches the workers; `gpus_per_engine` is each engine's TP; `backend()`: the engines' backend
    (embedded or sglang, known once they started), which picks the group's transport."""

    def __init__(self, fan_out: FanOut, gpus_per_engine: int, backend: Callable[[], str | None]):
        self.fan_out, self.tp, self.backend = fan_out, gpus_per_engine, backend
        self.wait = fan_out.wait

    def world_size(self) -> int:
        return 1 + len(self.fan_out.worker_urls()) * self.tp

    def init_group(self, master_address: str, master_port: int, group_name: str = DEFAULT_GROUP_NAME,
                   backend: str | None = None, timeout: float = 600.0) -> dict[str, Future]:
        """POST /init_weights_update_group to every worker concurrently; returns {url: Future}."""
        urls = self.fan_out.worker_urls()
        payloads = [{"master_address": master_address, "master_port": int(master_port), "rank_offset": 1 + i * self.tp,
                     "world_size": 1 + len(urls) * self.tp, "group_name": group_name,
                     "backend": backend or ("nccl" if self.backend() == "sglang" else "gloo")} for i in range(len(urls))]
        return self.fan_out.submit("POST", "/init_weights_update_group", timeout=timeout, urls=urls, payloads=payloads)

    def begin(self, timeout: float = 120.0) -> WeightUpdateSessions:
        """Open SGLang's weight-update session on every worker (none where the server has no sessions); close it
        with `.close()` on the returned object after the last bucket."""
        sessions = WeightUpdateSessions(self.fan_out.pool, timeout)
        sessions.open(self.fan_out.worker_urls())
        return sessions

    def from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: int,
                         group_name: str = DEFAULT_GROUP_NAME, flush_cache: bool = True,
                         load_format: str | None = None, timeout: float = 600.0) -> dict[str, Future]:
        """POST /update_weights_from_distributed to every worker concurrently; returns {url: Future}. The engines
        then wait for the trainer to broadcast the tensors in `names` order."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"update_weights_from_distributed: names/dtypes/shapes lengths differ "
                             f"({len(names)}/{len(dtypes)}/{len(shapes)})")
        payload = {"names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
                   "shapes": [list(s) for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
                   "weight_version": str(int(weight_version))}
        if load_format is not None:
            payload["load_format"] = load_format
        return self.fan_out.submit("POST", "/update_weights_from_distributed", payload, timeout=timeout)

    def destroy_group(self, group_name: str = DEFAULT_GROUP_NAME, timeout: float = 120.0) -> dict[str, Future]:
        return self.fan_out.submit("POST", "/destroy_weights_update_group", {"group_name": group_name}, timeout=timeout)

    def from_disk(self, path: str, version: int, flush_cache: bool = True, abort_all_requests: bool = False,
                  timeout: float = 600.0) -> dict[str, object]:
        """Every worker loads `path` and tags its outputs with weight_version str(version); checks success."""
        payload = {"model_path": str(path), "weight_version": str(int(version)), "flush_cache": flush_cache,
                   "abort_all_requests": abort_all_requests}
        return self.fan_out.call("POST", "/update_weights_from_disk", payload, timeout, check_success=True)
