"""The partial-rollout buffer (APRIL), which owns the ledger (`slime/utils/ledger.py`).

`PartialRolloutBuffer` holds parked groups (unfinished, with their per-token fields; handed out first next step,
FIFO or by `--buffer-filter-path`) and ready groups (accepted after the step's target was met; handed out next
step). `save`/`load` persist both and the ledger atomically. `slime/ray/buffer.py` runs it as a Ray actor;
`call_maybe_remote` calls either; `take_groups` is how groups leave it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import tempfile
from collections import Counter
from typing import Any, Callable

from slime.utils.ledger import DROPPED, FINISHED, ISSUED, PARKED, Ledger, LedgerError, group_id, is_group_finished
from slime.utils.misc import load_function, run_sync
from slime.utils.plugin_args import plugin_args
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

SAVE_FORMAT_VERSION = 1
RPC_TIMEOUT_S = 120.0  # a buffer or data-source call (the step uses --rollout-rpc-timeout)


def buffer_filter(path: str) -> Callable[[Any, list, int], Any]:
    """`--buffer-filter-path` as `f(args, parked, num)`: upstream's 4-argument filter gets rollout_id None (as
    upstream passes it), the older 3-argument one is called as it is; any other signature is refused now."""
    fn = load_function(path)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: trust upstream's signature
        return lambda args, parked, num: fn(args, None, parked, num)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params) or len(positional) == 4:
        return lambda args, parked, num: fn(args, None, parked, num)
    if len(positional) == 3:
        return fn
    raise TypeError(f"--buffer-filter-path {path} takes {len(positional)} positional arguments; it must be "
                    "upstream slime's def f(args, rollout_id, buffer, num_samples) -> list of groups")


class PartialRolloutBuffer:
    """Parked partial groups + ready finished groups + the ledger (plain class; `Buffer` is the Ray actor)."""

    def __init__(self, args: Any = None) -> None:
        self.args = args
        self.ledger = Ledger()
        self._parked: list[list[Sample]] = []
        self._ready: list[list[Sample]] = []
        path = args.buffer_filter_path if args is not None else None
        self._filter = buffer_filter(path) if path else None

    # ---- ledger passthrough --------------------------------------------------
    def mark(self, group_ids: list[int], state: str, reason: str | None = None) -> None:
        self.ledger.mark(group_ids, state, reason)

    def issue(self, groups: list[list[Sample]]) -> None:
        """Record fresh groups as issued (the rollout calls this before submitting them)."""
        self.ledger.mark([group_id(g) for g in groups], ISSUED)

    def drop_rows(self, reasons: dict[int, str]) -> None:
        self.ledger.drop_rows(reasons)

    def ledger_summary(self) -> dict[str, int]:
        return self.ledger.summary()

    def group_state(self, gid: int) -> str | None:
        return self.ledger.state(gid)

    def check_balanced(self, idle: bool = True) -> dict[str, int]:
        return self.ledger.check_balanced(
            [group_id(g) for g in self._parked], [group_id(g) for g in self._ready], idle=idle
        )

    # ---- parked groups ---------------------------------------------------------
    def park(self, groups: list[list[Sample]]) -> None:
        """Hold unfinished groups (issued -> parked); finished members are kept as they are."""
        ids = [group_id(g) for g in groups]
        done = [gid for gid, g in zip(ids, groups) if is_group_finished(g)]
        if done:
            raise LedgerError(f"cannot park finished groups {done[:10]} (every member is finished)")
        self.ledger.mark(ids, PARKED)
        self._parked.extend(groups)

    def num_parked(self) -> int:
        return len(self._parked)

    def parked_ids(self) -> list[int]:
        return [group_id(g) for g in self._parked]

    def take_parked(self, num: int) -> list[list[Sample]]:
        """Hand out up to `num` parked groups (FIFO or the buffer filter) and mark them issued."""
        if num <= 0 or not self._parked:
            return []
        if self._filter is None:
            chosen = self._parked[:num]
        else:
            chosen = self._filter(plugin_args(self.args), list(self._parked), num)
            self._check_filter_result(chosen, num)
        chosen_ids = {id(g) for g in chosen}
        self.ledger.mark([group_id(g) for g in chosen], ISSUED)
        self._parked = [g for g in self._parked if id(g) not in chosen_ids]
        return list(chosen)

    def _check_filter_result(self, chosen: Any, num: int) -> None:
        where = f"--buffer-filter-path {self.args.buffer_filter_path!r}"
        if not isinstance(chosen, list):
            raise TypeError(f"{where} must return a list of groups, got {type(chosen).__name__}")
        if len(chosen) > num:
            raise ValueError(f"{where} returned {len(chosen)} groups but only {num} were asked for")
        held = {id(g) for g in self._parked}
        seen: set[int] = set()
        for i, g in enumerate(chosen):
            if id(g) not in held:
                raise ValueError(f"{where} returned group #{i} that is not one of the parked groups (must return a subset)")
            if id(g) in seen:
                raise ValueError(f"{where} returned parked group {group_id(g)} twice")
            seen.add(id(g))

    # ---- ready (finished, accepted, not yet handed out) groups ----------------
    def hold_ready(self, groups: list[list[Sample]]) -> None:
        """Keep finished groups (already `finished` in the ledger) for the next step."""
        for g in groups:
            gid = group_id(g)
            if not is_group_finished(g):
                raise LedgerError(f"group {gid} is not finished; park it instead of holding it ready")
            if self.ledger.state(gid) != FINISHED:
                raise LedgerError(f"group {gid} is {self.ledger.state(gid) or 'new'} in the ledger, not finished")
        self._ready.extend(groups)

    def num_ready(self) -> int:
        return len(self._ready)

    def take_ready(self, num: int) -> list[list[Sample]]:
        """Hand out up to `num` ready groups, oldest first (they stay `finished`)."""
        out, self._ready = self._ready[: max(num, 0)], self._ready[max(num, 0) :]
        return out

    # ---- persistence -------------------------------------------------------------
    def save(self, path: str) -> None:
        """Write parked + ready groups and the ledger to `path` atomically (tmp file + os.replace)."""
        state = {
            "format_version": SAVE_FORMAT_VERSION,
            "parked": [[s.to_dict() for s in g] for g in self._parked],
            "ready": [[s.to_dict() for s in g] for g in self._ready],
            "ledger": self.ledger.state_dict(),
        }
        try:
            text = json.dumps(state)
        except TypeError as e:
            raise TypeError(f"buffer.save({path}): a sample field (metadata?) is not JSON-serialisable: {e}") from e
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".buffer-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        logger.info("buffer saved to %s: %d parked, %d ready groups", path, len(self._parked), len(self._ready))

    def load(self, path: str) -> None:
        """Replace this buffer's contents with what `save(path)` wrote."""
        try:
            with open(path) as f:
                state = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"buffer.load: cannot read {path}: {e}") from e
        if state.get("format_version") != SAVE_FORMAT_VERSION:
            raise ValueError(f"buffer.load: {path} has format_version {state.get('format_version')!r}, expected {SAVE_FORMAT_VERSION}")
        ledger = Ledger()
        ledger.load_state_dict(state["ledger"])
        parked = [[Sample.from_dict(d) for d in g] for g in state["parked"]]
        ready = [[Sample.from_dict(d) for d in g] for g in state["ready"]]
        ledger.check_balanced([group_id(g) for g in parked], [group_id(g) for g in ready], idle=False)
        lost = ledger.ids_in(ISSUED)
        if lost:  # saved mid-step: their samples were not saved, so they can never come back
            logger.warning("buffer.load: %d groups were issued when %s was saved; marking them dropped", len(lost), path)
            ledger.mark(lost, DROPPED, reason="issued_at_save")
        self.ledger, self._parked, self._ready = ledger, parked, ready
        logger.info("buffer loaded from %s: %d parked, %d ready groups", path, len(parked), len(ready))


# ---- calling the buffer (a Ray actor, or the object itself) ------------------------------------------------
async def call_maybe_remote(obj: Any, method: str, *args: Any, timeout: float = RPC_TIMEOUT_S) -> Any:
    """Call `obj.method(*args)`: through Ray (awaited, with `timeout`) for an actor handle, through a handle that
    restarts its actor (slime/ray/buffer.py's `RestartableBuffer`), directly otherwise."""
    if hasattr(obj, "call_restarting"):
        return await obj.call_restarting(method, *args, timeout=timeout)
    fn = getattr(obj, method)
    remote = getattr(fn, "remote", None)
    if remote is None:
        return fn(*args)
    ref = remote(*args)
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout)
    except TimeoutError as e:
        raise TimeoutError(f"{type(obj).__name__}.{method} did not answer within {timeout}s") from e


def call_sync(obj: Any, method: str, *args: Any, timeout: float = RPC_TIMEOUT_S) -> Any:
    """`call_maybe_remote` from synchronous code."""
    return run_sync(call_maybe_remote(obj, method, *args, timeout=timeout))


async def take_groups(buffer, data_source, num: int, n: int | None, cap, train_version: int,
                      timeout: float) -> tuple[list[list], list[list], Counter]:
    """The one way groups leave the buffer and the data source (the step's supply, upstream's `get_samples`):
    (parked, fresh, staleness counts), up to `num` groups, the buffer's parked ones first (`cap` applied
    against `train_version`), then fresh ones from `data_source` (None: ask it nothing), `issued` in the
    ledger; each of `n` samples (None: unchecked)."""
    parked = []
    if buffer is not None and num > 0:
        parked = list(await call_maybe_remote(buffer, "take_parked", num, timeout=timeout))
    counts = cap.at_resume(parked, train_version) if cap is not None else Counter()
    fresh = []
    if data_source is not None and len(parked) < num:
        fresh = list(await call_maybe_remote(data_source, "get_groups", num - len(parked), timeout=timeout))
        for g in fresh:
            if n is not None and len(g) != n:
                raise ValueError(f"data source returned group {group_id(g)} with {len(g)} samples; "
                                 f"--n-samples-per-prompt is {n}")
        if fresh and buffer is not None:
            await call_maybe_remote(buffer, "issue", fresh, timeout=timeout)
    return parked, fresh, counts
