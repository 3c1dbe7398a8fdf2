"""The partial-rollout buffer as a Ray actor: one owner of the parked and ready groups and the ledger for the
whole run (the class itself is slime/rollout/buffer.py). `Buffer` is made on first use, so importing this module
needs no Ray (the rollout benchmark runs where Ray is not installed).

`RestartableBuffer` (`--use-fault-tolerance`): the run's handle on the actor, which starts it again when it dies
from the newest checkpoint and replays, in order, every call that changed the buffer since (docs/faults.md)."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Any

from slime.ray.restarts import TOGETHER
from slime.rollout.buffer import PartialRolloutBuffer
from slime.utils.ledger import group_id

logger = logging.getLogger(__name__)

# the calls that change the buffer (kept for a replay); `load` starts over from a file, `save` writes one
CHANGES = frozenset({"mark", "issue", "drop_rows", "park", "take_parked", "hold_ready", "take_ready"})
TAKES = frozenset({"take_parked", "take_ready"})


def __getattr__(name: str):
    if name == "Buffer":  # the Ray actor class; Ray is imported only by those who ask for it
        import ray

        actor = ray.remote(num_cpus=0)(PartialRolloutBuffer)
        globals()["Buffer"] = actor
        return actor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def start_buffer(args):
    """The buffer actor, on the driver's node (it writes its part of each checkpoint next to the driver's)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return __getattr__("Buffer").options(scheduling_strategy=here).remote(args)


class BufferRestartsExhausted(RuntimeError):
    """The buffer actor died after the restart budget was spent."""


class BufferReplayError(RuntimeError):
    """A restarted buffer did not come back to the dead one's state; the message says where it parted."""


_NONE = object()


@dataclass
class _Call:
    method: str
    args: tuple  # lists and dicts as ObjectRefs: the call's arguments as they were sent
    pending: bool = True  # its caller has no result yet
    taken: list[int] | None = None  # take_*: the groups it handed out (its replay must hand out the same)
    replayed: Any = _NONE  # what its replay returned, for a caller still waiting


class RestartableBuffer:
    """See the module docstring. `call_restarting` is how `call_maybe_remote` reaches it; `checkpointed` after each
    checkpoint. Restarts spend from the run's budget (`--max-engine-restarts`, slime/ray/restarts.py)."""

    def __init__(self, args, budget):
        self.args, self.budget = args, budget
        self.base: str | None = None  # buffer.json of the newest checkpoint (None: the run's empty start)
        self.journal: list[_Call] = []  # the calls that changed the buffer since `base`, in the order it got them
        self._saved_at = 0  # journal length when the newest save was sent
        self._lock = threading.Lock()
        self.actor, self.generation = start_buffer(args), 0
        if not args.save:
            logger.warning("--use-fault-tolerance without --save: a restarted buffer replays every buffer call of "
                           "the run, kept in Ray's object store for the whole run")

    def _send(self, method: str, args: tuple) -> tuple[_Call | None, Any, int, int]:
        """(its journal entry, the ObjectRef of its reply, the journal's length, the actor's generation)."""
        import ray

        with self._lock:  # one order for the journal and the actor (Ray runs one caller's calls in order)
            call = None
            if method in CHANGES:
                call = _Call(method, tuple(ray.put(a) if isinstance(a, (list, dict)) else a for a in args))
                self.journal.append(call)
                args = call.args
            elif method == "save":
                self._saved_at = len(self.journal)
            return call, getattr(self.actor, method).remote(*args), len(self.journal), self.generation

    async def call_restarting(self, method: str, *args, timeout: float) -> Any:
        import ray

        call, ref, at, generation = self._send(method, args)
        while True:
            try:
                result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
            except TimeoutError as e:
                raise TimeoutError(f"the buffer actor's {method} did not answer within {timeout}s") from e
            except ray.exceptions.ActorDiedError as e:
                await asyncio.to_thread(self._restart, generation, e)
                if call is None:  # a read, save or load: asked again of the new actor
                    _, ref, at, generation = self._send(method, args)
                    continue
                if call.replayed is _NONE:
                    raise BufferReplayError(f"the buffer's {method} was sent before the newest checkpoint and is "
                                            "not in its replay") from e
                result, call.replayed = call.replayed, _NONE  # it ran again in the replay
            break
        if call is not None:
            call.pending = False
            if method in TAKES:
                call.taken = [group_id(g) for g in result]
        elif method == "load":  # the actor holds that file's state: replays start there
            self._rebase(args[0], at)
        return result

    def checkpointed(self, path: str) -> None:
        """The newest save is published at `path` (its buffer.json): replays start there."""
        self._rebase(path, self._saved_at)

    def _rebase(self, path: str, at: int) -> None:
        with self._lock:
            self.base, self.journal = path, self.journal[at:]
            self._saved_at = 0

    def _restart(self, generation: int, error: BaseException) -> None:
        import ray

        with self._lock:
            if generation != self.generation:  # another caller restarted it already
                return
            while True:
                if not self.budget.spend("buffer"):
                    raise BufferRestartsExhausted(
                        f"giving up on the buffer actor after {self.budget.used} restart(s) (--max-engine-restarts "
                        f"{self.budget.limit}: {TOGETHER})") from error
                logger.warning("restart %s: the buffer actor died (%s); a new one starts from %s and replays the %d "
                               "call(s) that changed the buffer since (the engines, the router and the trainer keep "
                               "running)", self.budget.progress(), type(error).__name__,
                               self.base or "an empty buffer (no checkpoint yet)", len(self.journal))
                try:
                    self._replay()
                    return
                except ray.exceptions.ActorDiedError as e:  # the new one died too: counted and tried again
                    error = e

    def _replay(self) -> None:
        import ray

        self.actor, self.generation = start_buffer(self.args), self.generation + 1
        first = [self.actor.load.remote(self.base)] if self.base else []
        refs = first + [getattr(self.actor, c.method).remote(*c.args) for c in self.journal]
        try:
            results = ray.get(refs, timeout=self.args.rollout_rpc_timeout)[len(first):]
            summary = ray.get(self.actor.check_balanced.remote(False), timeout=self.args.rollout_rpc_timeout)
        except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:  # (a death is the caller's)
            raise BufferReplayError(f"replaying the buffer's calls on {self.base or 'an empty buffer'} failed: "
                                    f"{getattr(e, 'cause', None) or e}") from e
        for i, (c, result) in enumerate(zip(self.journal, results)):
            if c.taken is not None and [group_id(g) for g in result] != c.taken:
                raise BufferReplayError(
                    f"replayed call {i} ({c.method}) handed out groups {[group_id(g) for g in result][:10]}, the dead "
                    f"buffer {c.taken[:10]}: a --buffer-filter-path that chooses differently on the same groups "
                    "cannot be replayed")
            if c.pending:
                c.replayed = result
        logger.warning("buffer actor restarted from %s: replayed %d call(s); it holds %d parked and %d finished groups",
                       self.base or "an empty buffer", len(self.journal), summary["parked"], summary["finished"])


__all__ = ["BufferReplayError", "BufferRestartsExhausted", "PartialRolloutBuffer", "RestartableBuffer",
           "start_buffer"]  # and Buffer, made on first use
