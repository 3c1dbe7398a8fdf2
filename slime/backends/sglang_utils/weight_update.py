"""The trainer's weight push as the engines see it: calls fanned out to every worker, returning futures so the
trainer can broadcast tensors while the engines wait in their receive (init_group, begin, from_distributed, the
broadcast, the session's close, destroy_group). Engine i gets rank_offset 1 + i * tp in the group."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

from slime.backends.sglang_utils.fan_out import FanOut
from slime.backends.sglang_utils.weight_session import WeightUpdateSessions

DEFAULT_GROUP_NAME = "weight_update_group"


class WeightPush:
    """`backend()`: the engines' backend (known once they started), which picks the group's transport."""

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
        """Open SGLang's weight-update session on every worker; `.close()` it after the last bucket."""
        sessions = WeightUpdateSessions(self.fan_out.pool, timeout)
        sessions.open(self.fan_out.worker_urls())
        return sessions

    def from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], weight_version: int,
                         group_name: str = DEFAULT_GROUP_NAME, flush_cache: bool = True,
                         load_format: str | None = None, timeout: float = 600.0) -> dict[str, Future]:
        """POST /update_weights_from_distributed to every worker concurrently (they then wait for the trainer's
        broadcast of `names` in order); returns {url: Future}."""
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
