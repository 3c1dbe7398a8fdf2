"""One sample's generation over SGLang's HTTP API: `SampleRequester.generate` sends `POST /generate` from the
token ids so far, appends the segment and sets the status (an engine's 4xx fails the sample, never the step); a
`--custom-generate-function-path` (upstream's signature) replaces the request loop."""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

from slime.backends.sglang_utils import http_client
from slime.rollout.engine_versions import VersionLabels, cache_key
from slime.rollout.multi_turn import AgentScope, ToolAgent, agent_scope
from slime.rollout.multi_turn.model_turn import ModelTurn, Segment, TurnRefused
from slime.utils.engine_reply import GenerateResponseError, token_versions  # noqa: F401 (re-exported)
from slime.utils.hf_dir import eos_token_ids
from slime.utils.misc import load_function
from slime.utils.plugin_args import plugin_args
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

MAX_UNEXPECTED_ABORTS = 3

# The step a plugin's generate call runs for (upstream's `GenerateState.aborted`): a context variable, so the
# tasks of each step see their own step, and a generate outside any step (an evaluation) sees none.
T = TypeVar("T")
_STEP_STOP: ContextVar[asyncio.Event | None] = ContextVar("slime_step_stop", default=None)


async def in_step(stop: asyncio.Event | None, call: Awaitable[T]) -> T:
    """Await `call` (a plugin's generate) as part of the step whose stop event is `stop` (None: no step)."""
    token = _STEP_STOP.set(stop)
    try:
        return await call
    finally:
        _STEP_STOP.reset(token)


def step_stopping() -> bool:
    """Whether the step the running plugin call belongs to is stopping (False outside a step)."""
    stop = _STEP_STOP.get()
    return stop is not None and stop.is_set()


def args_with_router(args, router_url: str):
    """`args` as a plugin sees them (`plugin_args`: writable, one per process): `sglang_router_ip` /
    `sglang_router_port` name the router the rollout uses (upstream slime's plugins post to it from there)."""
    view, router = plugin_args(args), urlsplit(router_url)
    view.sglang_router_ip, view.sglang_router_port = router.hostname, router.port
    return view


def sampling_params_from_args(args, evaluation: bool = False) -> dict[str, Any]:
    """SGLang sampling_params (without max_new_tokens) from the rollout (or eval) flags."""
    temperature = args.eval_temperature if evaluation else args.rollout_temperature
    top_p = args.eval_top_p if evaluation else args.rollout_top_p
    sp: dict[str, Any] = {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(args.eval_top_k if evaluation else args.rollout_top_k),
        "skip_special_tokens": bool(args.rollout_skip_special_tokens),
        "no_stop_trim": True,
    }
    if args.rollout_stop:
        sp["stop"] = list(args.rollout_stop)
    if args.rollout_stop_token_ids:
        sp["stop_token_ids"] = [int(t) for t in args.rollout_stop_token_ids]
    if args.rollout_ignore_eos:
        sp["ignore_eos"] = True
    return sp


def parse_segment(out: dict, url: str) -> tuple[list[int], list[float], list[int] | None, str, str]:
    """(token ids, log-probs, versions or None, text, finish type) from one /generate reply."""
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        raise GenerateResponseError(f"{url}/generate: reply has no meta_info object: {str(out)[:300]}")
    ids = out.get("output_ids")
    if ids is None:
        raise GenerateResponseError(f"{url}/generate: reply has no output_ids (rid {meta.get('id')})")
    lps = meta.get("output_token_logprobs") or []
    if len(lps) != len(ids):
        raise GenerateResponseError(f"{url}/generate: {len(ids)} output_ids but {len(lps)} output_token_logprobs "
                                    f"(rid {meta.get('id')}; was return_logprob honoured?)")
    for k, (entry, tok) in enumerate(zip(lps, ids)):
        if int(entry[1]) != int(tok):
            raise GenerateResponseError(f"{url}/generate: output_token_logprobs[{k}] is for token {entry[1]}, "
                                        f"output_ids[{k}] is {tok} (rid {meta.get('id')})")
    finish = meta.get("finish_reason")
    ftype = finish.get("type") if isinstance(finish, dict) else finish
    if ftype not in ("stop", "length", "abort"):
        raise GenerateResponseError(f"{url}/generate: unexpected finish_reason {finish!r} (rid {meta.get('id')})")
    versions = token_versions(meta, len(ids), f"{url}/generate (rid {meta.get('id')})")
    return [int(t) for t in ids], [float(e[0]) for e in lps], versions, out.get("text") or "", ftype


@dataclass
class VersionWindow:
    """Our record of a request: the versions its reply may carry, `sent` .. `newest()`; `span_lag`: see lag_spans."""

    sent: int
    newest: Callable[[], int]
    span_lag: int = 0


def finished_by_token(finish: str, ids: list[int], sampling_params: dict, hf_checkpoint: str) -> str:
    """"stop" for an aborted reply whose last token ends the request: SGLang applies an abort arriving with a
    token before checking it, so resumed, the request would generate past its end."""
    if finish != "abort" or not ids or sampling_params.get("ignore_eos"):
        return finish
    ends = eos_token_ids(hf_checkpoint) | set(sampling_params.get("stop_token_ids") or ())
    return "stop" if ids[-1] in ends else finish


class RequestLoop:
    """A sample's requests until it finishes; `send` is the transport's (HTTP or the simulator's)."""

    custom_generate = None
    max_context_len: int | None = None  # --rollout-max-context-len: prompt + response at most

    def __init__(self, max_response_len: int, rollout_id: int = 0):
        self.max_len = int(max_response_len)
        self.rollout_id = rollout_id
        self.new_tokens = 0
        self.requests = 0
        self.in_flight = 0
        self.peak_in_flight = 0
        self.timeline: list[tuple[float, int]] = []  # (loop time, in flight) at each change (the trace's occupancy)

    def budget(self, sample: Sample) -> int:
        """The response budget: the flag, a smaller per-sample one, or what the context leaves."""
        own = sample.metadata.get("max_response_len") if isinstance(sample.metadata, dict) else None
        budget = self.max_len if own is None else min(self.max_len, int(own))
        if self.max_context_len is not None:
            budget = min(budget, self.max_context_len - sample.prompt_length)
        return budget

    def at_budget(self, sample: Sample) -> bool:
        """True (and the sample TRUNCATED) when it has no budget left: it is never resumed forever."""
        if sample.response_length >= self.budget(sample):
            sample.status = Status.TRUNCATED
            return True
        return False

    def new_rid(self, sample: Sample) -> str:
        return f"r{self.rollout_id}-g{sample.group_index}-s{sample.index}-{uuid.uuid4().hex[:12]}"

    async def generate(self, sample: Sample, stop: asyncio.Event | None = None, attempt=None) -> bool:
        """Generate until `sample` finishes (True) or `stop` is set and the engines abort it (False). `attempt`:
        one request, returning (tokens appended, sent back to the gate), or None: the sample stays unfinished."""
        attempt = attempt or self.attempt
        unexpected_aborts = 0
        while True:
            if self.at_budget(sample):
                return True
            if stop is not None and stop.is_set():
                return False
            res = await attempt(sample, stop)
            if res is None:
                return False
            got, sent_back = res
            if sample.status.is_finished:
                return True
            if stop is not None and stop.is_set():
                return False
            if not sent_back:  # (back to the gate: paused for an update, backpressure, an eval, or stale)
                unexpected_aborts = self.resume_after_abort(sample, got, unexpected_aborts)

    async def attempt(self, sample: Sample, stop: asyncio.Event | None) -> tuple[int, bool] | None:
        if self.custom_generate is not None:  # the user's function runs once: what it leaves unfinished stays so
            await self.run_custom(sample, stop=stop)
            return (0, False) if sample.status.is_finished else None
        return await self.send(sample), False

    def resume_after_abort(self, sample: Sample, got: int, aborts: int) -> int:
        """An abort the step did not ask for (e.g. a weight update elsewhere): resume, a few times in a row."""
        aborts = 0 if got else aborts + 1
        if aborts > MAX_UNEXPECTED_ABORTS:
            raise GenerateResponseError(f"sample {sample.index} was aborted {aborts} times in a row with no progress")
        logger.info("sample %s aborted by the engine before the step ended; resuming it", sample.index)
        return aborts

    async def send(self, sample: Sample, rid: str | None = None, window: VersionWindow | None = None) -> int:
        """One request for `sample`: its segment appended and its status set; returns the tokens appended."""
        raise NotImplementedError

    def _in_flight(self, delta: int) -> None:
        self.in_flight += delta
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self.timeline.append((asyncio.get_running_loop().time(), self.in_flight))


class SampleRequester(RequestLoop):
    """Sends samples' requests through one URL (the router)."""

    def __init__(self, args, session, url: str, sampling_params: dict[str, Any], rollout_id: int,
                 policy_version: int, max_response_len: int | None = None, evaluation: bool = False,
                 agent: ToolAgent | None = None):
        super().__init__(max_response_len or args.rollout_max_response_len, rollout_id)
        self.args, self.session, self.url = args, session, url
        self.sampling_params = sampling_params
        self.policy_version = policy_version
        self.timeout = float(args.rollout_request_timeout)
        self.evaluation = evaluation
        self.max_context_len = args.eval_max_context_len if evaluation else args.rollout_max_context_len
        self.agent = agent  # the RolloutManager's ToolAgent (--agent-env): the multi-turn generate runs with it
        path = args.custom_generate_function_path
        self.custom_generate = load_function(path) if path else None
        self.plugin_args = args_with_router(args, url) if path else args
        self._custom_takes_evaluation = (self.custom_generate is not None
                                         and "evaluation" in inspect.signature(self.custom_generate).parameters)
        self.refused = 0
        self.versions = VersionLabels(f"{url}/generate")

    def payload(self, sample: Sample, rid: str | None = None, sampling_params: dict | None = None,
                version: int | None = None) -> dict[str, Any]:
        """The /generate body: token ids, sampling params (budget left), log-probs, a rid, `version`'s cache key."""
        sp = sampling_params
        if sp is None:
            sp = dict(self.sampling_params, max_new_tokens=self.budget(sample) - sample.response_length)
        body = {"input_ids": list(sample.tokens), "sampling_params": sp, "return_logprob": True,
                "rid": rid or self.new_rid(sample)}
        if not self.args.reuse_stale_kv:
            body["extra_key"] = cache_key(self.policy_version if version is None else version)
        return body

    async def send(self, sample: Sample, rid: str | None = None, window: VersionWindow | None = None) -> int:
        """One `POST /generate` for `sample`; returns the tokens appended (`window`: the versions allowed)."""
        try:
            seg = await self.request(self.payload(sample, rid, version=window and window.sent), window, sample)
        except http_client.EngineHTTPError as e:
            if not e.is_refusal:
                raise
            self._refused(sample, e)  # this prompt can never be served: fail the sample, not the run
            return 0
        sample.append_response(seg.ids, seg.log_probs, seg.versions, seg.text)
        if seg.finish == "stop":
            sample.status = Status.COMPLETED
        elif seg.finish == "length" or sample.response_length >= self.budget(sample):
            sample.status = Status.TRUNCATED
        else:
            sample.status = Status.ABORTED
        return len(seg.ids)

    async def turn(self, sample: Sample, sampling_params: dict, rid: str | None = None,
                   window: VersionWindow | None = None) -> Segment:
        """One model turn of a multi-turn sample (a `ModelTurn`, slime/rollout/multi_turn/model_turn.py): the same
        request as `send`, with the turn's sampling params, nothing appended; a refusal raises `TurnRefused`."""
        try:
            return await self.request(self.payload(sample, rid, sampling_params, window and window.sent), window, sample)
        except http_client.EngineHTTPError as e:
            if not e.is_refusal:
                raise
            self.refused += 1
            raise TurnRefused(e.message) from e

    async def request(self, payload: dict[str, Any], window: VersionWindow | None, sample: Sample) -> Segment:
        """One `POST /generate` for `sample`; the reply checked (SGLang's contract, versions, length) and counted."""
        rid, max_new = payload["rid"], payload["sampling_params"]["max_new_tokens"]
        self.requests += 1
        self._in_flight(+1)
        try:
            out = await http_client.generate(self.session, self.url, payload, timeout=self.timeout)
        finally:
            self._in_flight(-1)
        ids, lps, versions, text, ftype = parse_segment(out, self.url)
        sent, newest = (window.sent, window.newest()) if window is not None else (self.policy_version,) * 2
        versions = self.versions.label_tokens(sample, versions, "weight_versions" in out["meta_info"], sent, newest, rid,
                                              window.span_lag if window is not None else 0)
        if len(ids) > max_new:
            raise GenerateResponseError(f"{self.url}/generate returned {len(ids)} tokens for max_new_tokens={max_new} "
                                        f"(rid {rid})")
        self.new_tokens += len(ids)
        return Segment(ids, lps, versions, text, finished_by_token(ftype, ids, payload["sampling_params"],
                                                                   self.args.hf_checkpoint))

    def _refused(self, sample: Sample, error: http_client.EngineHTTPError) -> None:
        sample.status = Status.FAILED
        sample.metadata["failure"] = f"engine_refused: {error.message}"
        self.refused += 1
        logger.warning("engine refused sample %s (group %s, %d prompt tokens): HTTP %d %s", sample.index,
                       sample.group_index, sample.prompt_length, error.status, error.message)

    async def run_custom(self, sample: Sample, version: int | None = None, stop: asyncio.Event | None = None,
                         turn: ModelTurn | None = None) -> bool:
        """Run the user's generate function (`version`: for tokens it added without one); with `--agent-env`, the
        built-in multi-turn generate inside its agent scope, each model turn sent by `turn`."""
        path = self.args.custom_generate_function_path
        where = f"--custom-generate-function-path {path}"
        before = sample.response_length
        sp = dict(self.sampling_params, max_new_tokens=self.budget(sample))
        kwargs = {"evaluation": self.evaluation} if self._custom_takes_evaluation else {}
        if self.agent is not None:  # its model turns are this requester's own requests (counted there)
            with agent_scope(AgentScope(self.agent, turn or self.turn, stop)):
                out = await self.custom_generate(self.plugin_args, sample, sp, **kwargs)
        else:
            self._in_flight(+1)
            try:  # in_step: upstream's GenerateState.aborted says when this step aborts
                out = await in_step(stop, self.custom_generate(self.plugin_args, sample, sp, **kwargs))
            finally:
                self._in_flight(-1)
        served = self.policy_version if version is None else version
        if isinstance(out, list):  # upstream's fan-out: several training samples from one rollout
            done = sample.adopt_fanout(out, served, where)
            if self.agent is None:
                self.new_tokens += sum(s.response_length for s in (sample, *sample.fanout)) - before
            return done
        if self.agent is None:
            self.new_tokens += sample.response_length - before
        if out is not sample:
            raise TypeError(f"{where}: must return the Sample it was given, or a list of Samples (got "
                            f"{type(out).__name__})")
        sample.complete_response(served, where)
        if sample.status is Status.PENDING:
            raise ValueError(f"{where}: sample {sample.index} came back PENDING; set its status (completed, "
                             "truncated, aborted or failed)")
        return sample.status.is_finished
