"""ToolAgent: one sample's multi-turn trajectory, model turns and tool calls, resumable at any point.

    while the budget lasts:
        a call left pending by an abort?  -> take its result (never run twice), append the observation
        model turn: POST /generate from the sample's tokens, stopped at the call's closing marker
            aborted            -> ABORTED (the turn stays open; it continues from its last token on resume)
            ends with a call   -> send it to the tool runner (pending), then its observation (loss mask 0)
            ends otherwise     -> the answer: COMPLETED (or TRUNCATED at a length limit)

A call lost with a killed run is run again only when its ToolSpec says `safe_to_rerun`, else the sample fails."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import uuid

from slime.rollout.multi_turn.model_turn import ModelTurn, TurnRefused
from slime.rollout.multi_turn.trajectory import KEY, Trajectory
from slime.utils.misc import load_function
from slime.utils.tool_calls import AgentEnv
from slime.utils.tool_runner import ToolResult, ToolRunner
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class ToolAgent:
    def __init__(self, env: AgentEnv, tokenizer, runner: ToolRunner, max_turns: int,
                 max_tokens_per_turn: int | None = None):
        if max_turns < 1 or (max_tokens_per_turn is not None and max_tokens_per_turn < 1):
            raise ValueError(f"ToolAgent: need max_turns >= 1 and max_tokens_per_turn >= 1 or None "
                             f"(got {max_turns}, {max_tokens_per_turn})")
        self.env, self.tokenizer, self.runner = env, tokenizer, runner
        self.max_turns, self.max_tokens_per_turn = max_turns, max_tokens_per_turn
        close = tokenizer.encode(env.call_format.call_close, add_special_tokens=False)
        # a one-token closing marker stops the engine by id (exact, cheap); otherwise by string
        self.close_token_id = close[0] if len(close) == 1 else None

    @classmethod
    def from_args(cls, args, tokenizer) -> "ToolAgent":
        """The agent of `--agent-env` with its own ToolRunner (the caller owns it: `close()` when done)."""
        env = load_function(args.agent_env)
        if not isinstance(env, AgentEnv):
            raise TypeError(f"--agent-env {args.agent_env}: is a {type(env).__name__}, not an AgentEnv "
                            "(slime/utils/tool_calls.py)")
        for spec in env.tools:  # found without importing it here: tools are imported only in their workers
            module = spec.function.rpartition(".")[0]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ImportError(f"--agent-env {args.agent_env}: tool {spec.name!r} names {spec.function}, but there "
                                  f"is no module {module}")
        runner = ToolRunner(workers=args.tool_workers, timeout_s=args.tool_timeout,
                            max_output_chars=args.tool_max_output_chars, memory_mb=args.tool_memory_mb)
        return cls(env, tokenizer, runner, args.max_turns, args.max_tokens_per_turn)

    def close(self) -> None:
        self.runner.close()

    def turn_params(self, sampling_params: dict, max_new_tokens: int) -> dict:
        sp = dict(sampling_params, max_new_tokens=max_new_tokens, no_stop_trim=True)
        if self.close_token_id is not None:
            sp["stop_token_ids"] = sorted({*sp.get("stop_token_ids", []), self.close_token_id})
        else:
            stops = sp.get("stop") or []
            sp["stop"] = [*([stops] if isinstance(stops, str) else stops), self.env.call_format.call_close]
        return sp

    async def run(self, sample: Sample, sampling_params: dict, model: ModelTurn,
                  stop: asyncio.Event | None = None) -> Sample:
        """Go on with `sample` until it is finished or stopped (ABORTED, resumable); returns the sample."""
        if sample.response_length == 0:
            self._release_dropped_calls(sample)
        traj = Trajectory.of(sample)
        limit = int(sampling_params["max_new_tokens"])  # the whole response budget (upstream's convention)
        while True:
            if traj.pending_call() is not None:
                if not await self._take_result(sample, traj, limit, stop):
                    sample.status = Status.ABORTED  # stopped while the tool runs: resumed with the call pending
                    return sample
                if sample.status.is_finished:
                    return sample
            left = limit - sample.response_length
            if left <= 0:
                sample.status = Status.TRUNCATED
                return sample
            if stop is not None and stop.is_set():
                sample.status = Status.ABORTED
                return sample
            turn = traj.open_turn()
            if turn is None and traj.model_turns() >= self.max_turns:
                sample.status = Status.TRUNCATED
                return sample
            so_far = 0 if turn is None else turn["end"] - turn["start"]
            per_turn = left if self.max_tokens_per_turn is None else min(left, self.max_tokens_per_turn - so_far)
            if per_turn <= 0:  # an open turn at its own budget (the budget shrank across a restart)
                traj.close_turn("length")
                sample.status = Status.TRUNCATED
                return sample
            try:
                seg = await model(sample, self.turn_params(sampling_params, per_turn))
            except TurnRefused as e:  # this context can never be served: fail the sample, not the run
                sample.status = Status.FAILED
                sample.metadata["failure"] = f"engine_refused: {e}"
                return sample
            if len(seg.ids) > per_turn:
                raise ValueError(f"the engine returned {len(seg.ids)} tokens for max_new_tokens={per_turn} "
                                 f"(sample {sample.index})")
            sample.append_response(seg.ids, seg.log_probs, seg.versions, seg.text)
            if seg.ids:
                traj.model_tokens_added(len(seg.ids))
            if seg.finish == "abort":
                sample.status = Status.ABORTED
                return sample
            turn = traj.open_turn()
            if turn is None:  # an empty reply that was not aborted: nothing to read, the model said nothing
                sample.status = Status.TRUNCATED if seg.finish == "length" else Status.COMPLETED
                return sample
            text = self.tokenizer.decode(sample.response_tokens[turn["start"]:turn["end"]], skip_special_tokens=False)
            call = self.env.parse_call(text.rstrip())
            if call is None:
                traj.close_turn("answer" if seg.finish == "stop" else "length")
                sample.status = Status.COMPLETED if seg.finish == "stop" else Status.TRUNCATED
                return sample
            if traj.model_turns() >= self.max_turns or sample.response_length >= limit:
                # its answer could never be read (no turn left, or no room left): the call is not run
                traj.close_turn("turn_limit" if sample.response_length < limit else "length")
                sample.status = Status.TRUNCATED
                return sample
            traj.close_turn("call")
            if call.error is not None:
                traj.begin_call(uuid.uuid4().hex, call.name, call.arguments, state="bad_call")["error"] = call.error
                self._observe(sample, traj, self.env.bad_call_text(call.error), limit)
                continue
            record = traj.begin_call(uuid.uuid4().hex, call.name, call.arguments)
            self.runner.submit(record["id"], self.env.tool(call.name), call.arguments)

    def _release_dropped_calls(self, sample: Sample) -> None:
        """A staleness restart dropped the response its record describes: a call it left pending is withdrawn
        (or, running, its result is no longer kept); the trajectory starts again."""
        old = sample.metadata.get(KEY)
        for call in (old or {}).get("calls", []):
            if call["state"] == "pending":
                fut = self.runner.lookup(call["id"])
                if fut is not None:
                    fut.cancel()
                    self.runner.forget(call["id"])

    async def _take_result(self, sample: Sample, traj: Trajectory, limit: int, stop: asyncio.Event | None) -> bool:
        """The pending call's result into the sample; False when `stop` came first (the call stays pending)."""
        record = traj.pending_call()
        spec = self.env.tool(record["name"])
        if spec is None:
            return self._fail(sample, record, f"no tool named {record['name']!r} in this environment any more")
        fut = self.runner.lookup(record["id"])
        if fut is None or fut.cancelled():
            if fut is None:  # not this runner's call: the run stopped while it ran, its result is lost
                if not spec.safe_to_rerun:
                    return self._fail(sample, record, "its result was lost when the run stopped while it ran, and "
                                                      "the environment does not allow running it again")
                record["reran"] = True
                logger.info("sample %s: re-running tool call %s (%s), lost when the run stopped", sample.index,
                            record["id"], spec.name)
            fut = self.runner.submit(record["id"], spec, record["arguments"])
        result = await self._wait(fut, stop)
        if result is None:
            return False
        self.runner.forget(record["id"])
        record["seconds"] = round(result.seconds, 6)
        record["truncated"] = result.truncated
        if not result.ok:
            return self._fail(sample, record, result.error)
        obs = self.env.call_format.format_result(result.output)
        ids = self.tokenizer.encode(obs, add_special_tokens=False)
        unk = self.tokenizer.unk_token_id
        if unk is not None and unk in ids and self.tokenizer.unk_token not in obs:
            return self._fail(sample, record, f"returned text the tokenizer cannot encode: {result.output[:80]!r}")
        record["state"] = "done"
        self._observe(sample, traj, obs, limit, ids)
        return True

    @staticmethod
    async def _wait(fut, stop: asyncio.Event | None) -> ToolResult | None:
        if stop is not None and stop.is_set() and not fut.done():
            return None
        waiter = asyncio.wrap_future(fut)
        if stop is None:
            return await waiter
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            if not waiter.done():
                waiter.cancel()  # the call itself runs on (or, not yet started, is sent again on resume)
        return waiter.result() if waiter.done() and not waiter.cancelled() else None

    def _observe(self, sample: Sample, traj: Trajectory, text: str, limit: int, ids: list[int] | None = None) -> None:
        """Append an observation (loss mask 0, log-prob 0, the calling turn's version); cut at the budget."""
        ids = self.tokenizer.encode(text, add_special_tokens=False) if ids is None else ids
        room = limit - sample.response_length
        cut = len(ids) > room
        if cut:
            ids = ids[:max(0, room)]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        version = sample.weight_versions[-1] if sample.weight_versions else 0
        sample.append_response(ids, [0.0] * len(ids), version, text, loss_mask=[0] * len(ids))
        traj.observation_added(len(ids))
        if cut:
            sample.status = Status.TRUNCATED

    def _fail(self, sample: Sample, record: dict, error: str) -> bool:
        record["state"] = "failed"
        record["error"] = error
        sample.status = Status.FAILED
        sample.metadata["failure"] = f"tool: {record['name']}: {error}"
        logger.warning("sample %s (group %s): tool %s failed: %s", sample.index, sample.group_index, record["name"],
                       error)
        return True
