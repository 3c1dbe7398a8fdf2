"""The end of a rollout step (slime/rollout/sglang_rollout.py): stop, drain, settle, commit.

Once the target is met (or the step fails): abort every engine until idle and drain every request (each
returns its partial tokens; requests that reached an engine after it reported idle are aborted in the
next round; those on a failed engine are cancelled, their samples kept at the tokens it last returned);
then wait for the reward tasks still running (bounded: `--reward-timeout` + 30 s), and hand the buffer
the step's outcome in one batch of calls: finished groups marked, rejected ones dropped with their
reason, unfinished ones parked (`--partial-rollout`) or dropped, groups finished after the target kept
ready for the next step.

`StepEnd` is a mixin of `_RolloutStep`: it reads the step's state (groups, accepted, overflow, rejected,
tasks, reward_tasks, faults, halted, clock, counts) and writes `abort_point`, `abort_to_idle` and the counts of
parked / discarded groups.
"""

from __future__ import annotations

import asyncio
import logging

from slime.rollout.rm_hub import reward_timeout
from slime.rollout.sampling_request import call_maybe_remote
from slime.utils.ledger import DROPPED, FINISHED, group_id

logger = logging.getLogger(__name__)

# with --reward-timeout <= 0 (no per-reward limit) the step still stops waiting for rewards after the drain
UNLIMITED_REWARD_SETTLE_S = 300.0
# after an engine failed and the live ones are idle, requests still pending are on the failed one
FAULT_DRAIN_GRACE_S = 2.0


class StepEnd:
    async def _stop_and_drain(self, session) -> None:
        self.stop.set()
        self.clock.mark("stop")
        self.abort_point = {"t": round(self.clock.now(), 4), "accepted": len(self.accepted),
                            "finished_groups": self.counts["groups_finished"], "in_flight": self.requester.in_flight}
        self.abort_to_idle = 0.0
        deadline = self.clock.now() + self.abort_timeout
        while True:
            try:
                # nothing of ours running (e.g. paused at a version gate while an eval uses the engines): no abort
                if self.requester.in_flight:
                    res = await self._abort_live_engines(session)
                    self.abort_to_idle = self.abort_to_idle or float(res or 0.0)
            except Exception as e:
                if not self.errors:
                    self._fail(f"aborting the engines: {type(e).__name__}: {e}")
                else:
                    logger.warning("abort after failure also failed: %s", e)
            if not self.tasks:
                break
            # requests that reached an engine after it reported idle are aborted in the next round
            await asyncio.wait(set(self.tasks), timeout=FAULT_DRAIN_GRACE_S if self.faults else 1.0)
            if not self.tasks:
                break
            if self.faults:  # the live engines are idle: what is still pending waits on the failed engine
                logger.warning("rollout step %d: %d requests were on the failed engine; their samples resume from "
                               "the tokens it last returned", self.rollout_id, len(self.tasks))
                for t in list(self.tasks):
                    t.cancel()
                await asyncio.wait(set(self.tasks), timeout=10)
                break
            if self.clock.now() > deadline:
                self._fail(f"{len(self.tasks)} requests still pending {self.abort_timeout}s after the abort")
                for t in list(self.tasks):
                    t.cancel()
                await asyncio.wait(set(self.tasks), timeout=10)
                break
        self.clock.mark("drained")

    async def _abort_live_engines(self, session):
        """Abort-all on every engine not known to have failed, until they are idle. An engine the watchdog finds
        failed while the abort waits on it (it stopped just before the step ended) leaves the abort at once: a
        stopped engine never answers, and the abort would otherwise wait out --rollout-abort-timeout."""
        while True:
            self.fault_seen.clear()
            known = set(self.faults)
            call = self.ctx.engines.abort_all_until_idle(timeout=self.abort_timeout, session=session, exclude=known)
            if not asyncio.iscoroutine(call):  # an engine group answering synchronously
                return call
            abort = asyncio.ensure_future(call)
            while not abort.done():
                fault = asyncio.ensure_future(self.fault_seen.wait())
                await asyncio.wait({abort, fault}, return_when=asyncio.FIRST_COMPLETED)
                fault.cancel()
                self.fault_seen.clear()
                if not abort.done() and set(self.faults) - known:
                    abort.cancel()  # and again, without the engine that just failed
                    await asyncio.wait({abort})
                    logger.warning("rollout step %d: %s failed during the abort; aborting the other engines again",
                                   self.rollout_id, ", ".join(sorted(set(self.faults) - known)))
                    break
            else:
                return abort.result()

    async def _settle_rewards(self) -> None:
        timeout = (reward_timeout(self.args) or UNLIMITED_REWARD_SETTLE_S) + 30.0
        if self.reward_tasks:
            done, pending = await asyncio.wait(set(self.reward_tasks), timeout=timeout)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=10)
                self._fail(f"{len(pending)} reward tasks still running {timeout:.0f}s after the drain")
        self.clock.mark("rewarded")

    async def _commit(self) -> None:
        """Ledger + buffer: finished groups, rejected, parked or discarded (one batch of buffer calls)."""
        open_groups = [st.samples for st in self.groups.values() if st.outcome is None]
        unfinished = [g for g in open_groups if not all(s.status.is_finished for s in g)]
        for g in open_groups:  # generated but its reward never settled (timed out / cancelled)
            if all(s.status.is_finished for s in g):
                self.rejected[group_id(g)] = "reward_unsettled"
        buf = self.ctx.buffer
        finished_ids = [group_id(g) for g in self.accepted + self.overflow if group_id(g) in self.groups]
        by_reason: dict[str, list[int]] = {}
        for gid, reason in self.rejected.items():
            by_reason.setdefault(reason, []).append(gid)
        self.counts["parked"] = len(unfinished) if self.partial else 0
        self.counts["discarded"] = 0 if self.partial else len(unfinished)
        if buf is None:
            return
        calls = [("mark", finished_ids, FINISHED)] if finished_ids else []
        calls += [("mark", ids, DROPPED, reason) for reason, ids in by_reason.items()]
        if unfinished and self.partial:
            calls.append(("park", unfinished))
        elif unfinished:
            calls.append(("mark", [group_id(g) for g in unfinished], DROPPED, "discarded_unfinished"))
        if self.overflow:
            calls.append(("hold_ready", self.overflow))
        if (self.errors or self.halted) and self.accepted:  # the caller never sees them: keep them for the next step
            calls.append(("hold_ready", self.accepted))
        for name, *a in calls:
            await call_maybe_remote(buf, name, *a, timeout=self.rpc_timeout)
