"""The process group between a trainer and its engines for weight broadcasts, laid out as SGLang's
`init_custom_process_group` lays it out (store keys prefixed by group, then by torch per backend), so trainer and
embedded engine build it the same way."""

from __future__ import annotations

import datetime


def join(backend: str, store, rank: int, world_size: int, group_name: str, timeout: datetime.timedelta):
    """This process's member (`rank`) of the group `group_name` over `store` (the rendezvous TCPStore)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world

    if not group_name:
        raise ValueError("weight-update group: group_name must not be empty (SGLang refuses it too)")
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), dist.PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group ranks are global ranks here
    return pg


def leave(pg) -> None:
    """Destroy this member of the group (its name can then be joined again)."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)
