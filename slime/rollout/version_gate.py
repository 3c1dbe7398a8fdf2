"""VersionGate: pause a running rollout so the engines can change weights under it, every token's version exact.

Every request passes the gate (`GatedRequester`); `hold` drains the engines and the aborted samples resume from
their tokens after `release`, the staleness cap applied; paused updates (`--pause-mode retract|in_place`) are
bracketed by `begin_update` / `end_update` and `stale_requests` names what to abort by rid."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from slime.rollout.multi_turn.model_turn import Segment
from slime.rollout.sampling_request import VersionWindow

logger = logging.getLogger(__name__)


class VersionGate:
    def __init__(self, version: int, train_version: int | None = None):
        self.version = int(version)
        self.train_version = int(version if train_version is None else train_version)
        self._holds: set[str] = set()
        self._open = asyncio.Event()
        self._open.set()
        self._quiet = asyncio.Event()  # set while no request of ours is in flight
        self._quiet.set()
        self.in_flight = 0
        self.pending_version: int | None = None  # an in-place update to this version is being pushed
        # tokens at the start of each newer span the older weights may have sampled (engine_versions.lag_spans)
        self.span_lag = 0
        self._requests: dict[str, tuple[object, int]] = {}  # rid -> (sample, version when sent)
        self._aborted: set[str] = set()  # rids aborted as stale (in place), so their samples resume
        self.staleness = Counter()  # what the cap did at in-flight resumes (keys as StalenessCap.at_resume_in_flight's)
        self.pauses = 0
        self.pauses_by_reason: Counter = Counter()  # holds that closed an open gate (drained), by reason
        self.held_s = 0.0
        self.drain_s = 0.0
        self._closed_at: float | None = None

    # ---- the request side ------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def holds(self) -> frozenset[str]:
        return frozenset(self._holds)

    async def wait_open(self, stop: asyncio.Event | None = None) -> bool:
        """Wait until the gate is open (True) or `stop` is set (False)."""
        if self._open.is_set():
            return not (stop is not None and stop.is_set())
        if stop is None:
            await self._open.wait()
            return True
        opened, stopped = asyncio.ensure_future(self._open.wait()), asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({opened, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (opened, stopped):
                t.cancel()
        return not stop.is_set() and self._open.is_set()

    def window(self) -> VersionWindow:
        """Our record of a request sent now: the versions its reply may carry (`span_lag`: see engine_versions.py)."""
        return VersionWindow(self.version, lambda: self.newest_version, self.span_lag)

    @property
    def newest_version(self) -> int:
        """The newest version a reply may carry now (the one being pushed in place, if any)."""
        return self.version if self.pending_version is None else self.pending_version

    @contextlib.contextmanager
    def request(self, rid: str, sample):
        """Count one request in flight (entered right after `wait_open`, with no await in between)."""
        self.in_flight += 1
        self._requests[rid] = (sample, self.version)
        self._quiet.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._requests.pop(rid, None)
            if self.in_flight == 0:
                self._quiet.set()

    def was_aborted(self, rid: str) -> bool:
        """True (once) if `rid` was aborted by `abort_requests`."""
        if rid in self._aborted:
            self._aborted.discard(rid)
            return True
        return False

    # ---- the controller side ------------------------------------------------------
    async def hold(self, reason: str, engines, session=None, timeout: float = 120.0, drain: bool = True) -> float:
        """Close the gate for `reason`; `drain`: abort ours and wait for them. Returns the drain's seconds."""
        if self._open.is_set():
            self._closed_at = time.monotonic()
        self._holds.add(reason)
        self._open.clear()
        if not drain or not self.in_flight:
            return 0.0
        self.pauses += 1
        self.pauses_by_reason[reason] += 1
        t0 = time.monotonic()
        deadline = t0 + timeout
        while self.in_flight:
            # a request can reach an engine after it reported idle: abort again until ours are all back
            res = engines.abort_all_until_idle(timeout=max(1.0, deadline - time.monotonic()), session=session)
            if asyncio.iscoroutine(res):
                await res
            try:
                await asyncio.wait_for(self._quiet.wait(), timeout=0.5)
            except TimeoutError:
                pass
            if self.in_flight and time.monotonic() > deadline:
                raise TimeoutError(f"version gate ({reason}): {self.in_flight} requests still in flight "
                                   f"{timeout:.0f}s after aborting them")
        dt = time.monotonic() - t0
        self.drain_s += dt
        return dt

    def release(self, reason: str, version: int | None = None, train_version: int | None = None) -> bool:
        """Drop `reason`'s hold (and set the new versions); reopen if nothing else holds it. True if open."""
        self._holds.discard(reason)
        if version is not None:
            self.version = int(version)
        if train_version is not None:
            self.train_version = int(train_version)
        if not self._holds and not self._open.is_set():
            if self._closed_at is not None:
                self.held_s += time.monotonic() - self._closed_at
                self._closed_at = None
            self._open.set()
        return self._open.is_set()

    def set_version(self, version: int) -> None:
        """The engines now serve `version` (set while the gate is held, before it reopens)."""
        if self._open.is_set():
            raise RuntimeError("VersionGate.set_version: the gate is open (requests may be in flight)")
        self.version = int(version)

    # ---- in place ----------------------------------------------------------------------
    def begin_update(self, version: int) -> None:
        """An in-place push of `version` starts: requests keep running and may come back with its tokens."""
        self.pending_version = int(version)

    def end_update(self) -> None:
        """The push is done: every engine serves `pending_version`; requests sent from now on are at it."""
        if self.pending_version is not None:
            self.version, self.pending_version = self.pending_version, None

    def stale_requests(self, min_version: int) -> list[str]:
        """Requests in flight whose sample may hold a token older than `min_version`."""
        out = []
        for rid, (sample, sent) in self._requests.items():
            known = sample.oldest_version()
            if min(sent, known if known is not None else sent) < min_version:
                out.append(rid)
        return out

    async def abort_requests(self, rids: list[str], engines, session=None) -> None:
        """Abort `rids` on every engine (`engines.abort_requests`); their samples come back to the gate and resume."""
        if rids:
            self._aborted.update(rids)
            await engines.abort_requests(rids, session)

    def set_train_version(self, train_version: int) -> None:
        self.train_version = int(train_version)

    def stats(self) -> dict[str, float]:
        held = self.held_s + (time.monotonic() - self._closed_at if self._closed_at is not None else 0.0)
        return {"pauses": float(self.pauses), "held_s": held, "drain_s": self.drain_s}


class GatedRequester:
    """`requester.generate` through `gate`: requests wait while it is held and are counted in flight; an aborted
    sample resumes from its tokens, the cap applied, versions checked against its `VersionWindow`."""

    def __init__(self, requester, gate: VersionGate, cap):
        self.requester, self.gate, self.cap = requester, gate, cap

    async def generate(self, sample, stop: asyncio.Event | None = None) -> bool:
        """The requester's loop, each request through the gate."""
        seen = self.gate.version  # the version the sample last passed the staleness cap at

        async def through_gate(sample, stop) -> tuple[int, bool] | None:
            nonlocal seen
            r, gate = self.requester, self.gate
            if not await gate.wait_open(stop):
                return None
            if gate.version != seen:  # resumed across a weight update: the staleness cap
                seen = gate.version
                gate.staleness.update(self.cap.at_resume_in_flight(sample, gate.train_version))
            before = sample.response_length
            if r.custom_generate is not None:
                turn = GatedTurn(self, seen, stop)  # the multi-turn generate's model turns pass the gate one by one
                await r.run_custom(sample, version=gate.version, stop=stop, turn=turn)
                stale_abort = turn.sent_back
            else:
                rid = r.new_rid(sample)  # counted in flight from here, with no await since the gate let it pass
                with gate.request(rid, sample):
                    await r.send(sample, rid, gate.window())
                stale_abort = gate.was_aborted(rid)
            # paused (update, backpressure, eval, checkpoint) or stopped as stale: back to the gate
            return sample.response_length - before, stale_abort or not gate.is_open

        return await self.requester.generate(sample, stop, through_gate)


class GatedTurn:
    """A multi-turn sample's model turns through the gate; a turn at another version than `seen`, or stopped at
    the gate, is not sent: the sample parks and goes back to the gate (`sent_back`)."""

    def __init__(self, gated: GatedRequester, seen: int, stop: asyncio.Event | None):
        self.gated, self.seen, self.stop = gated, seen, stop
        self.sent_back = False

    async def __call__(self, sample, sampling_params: dict) -> Segment:
        r, gate = self.gated.requester, self.gated.gate
        if not await gate.wait_open(self.stop) or gate.version != self.seen:
            self.sent_back = True
            return Segment.not_sent(gate.version)
        rid = r.new_rid(sample)  # counted in flight from here, with no await since the gate let it pass
        with gate.request(rid, sample):
            seg = await r.turn(sample, sampling_params, rid, gate.window())
        if gate.was_aborted(rid) or (seg.finish == "abort" and not gate.is_open):
            self.sent_back = True
        return seg


__all__ = ["GatedRequester", "GatedTurn", "VersionGate"]
