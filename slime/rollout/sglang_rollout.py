"""APRIL against the real engines: the default rollout function (upstream slime's `generate_rollout`: one step of
the run's `Rollout`, `data_source.rollout`) and `EngineLink`, what that Rollout talks to. A dead or frozen engine,
named by the watchdog, stops the step as at its target (nothing lost), then `RolloutEngineFaultError` names it."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from tqdm import tqdm

from slime.rollout.base_types import RolloutOutput
from slime.rollout.eval_rollout import generate_eval
from slime.rollout.filter_hub import group_filter
from slime.rollout.generate_state import GenerateState
from slime.rollout.rm_hub import reward_group
from slime.rollout.rollout import Rollout, RolloutConfig, RolloutContext
from slime.rollout.rollout_metrics import EngineMonitors, step_metrics
from slime.rollout.sampling_request import SampleRequester, sampling_params_from_args
from slime.rollout.step import StepIO
from slime.rollout.step_record import RolloutEngineFaultError, RolloutError
from slime.utils.misc import run_sync
from slime.utils.types import expand_fanout

SESSION_EXTRA_CONNECTIONS = 32


def generate_rollout(args, rollout_id: int, data_source: RolloutContext, evaluation: bool = False) -> RolloutOutput:
    """(`args`: the plugins' view of the flags; the run's Rollout reads the validated ones.)"""
    rollout = data_source.rollout
    if evaluation:
        return run_sync(rollout.evaluate(rollout_id, data_source.eval_groups))
    return run_sync(rollout.step(rollout_id, halt=data_source.halt))  # train.py: the run's stop request


def engine_rollout(args, buffer, data_source, engines, agent=None, planner=None, policy_version: int = 0) -> Rollout:
    """The run's Rollout over real engines (an EngineGroup; the RolloutManager's, or a tool's / a test's)."""
    return Rollout(RolloutConfig.from_args(args), buffer, data_source, EngineLink(args, engines, agent), planner,
                   policy_version)


class EngineLink:
    """The engines behind the router as a step sees them: requests, reward and filter, metrics and trace."""

    def __init__(self, args, engines, agent=None):
        self.args, self.engines, self.agent = args, engines, agent  # agent: --agent-env's ToolAgent
        self.backend = engines.backend if engines is not None else None
        self.session: aiohttp.ClientSession | None = None
        self.occupancy: dict[str, float] = {}  # the last step's engine occupancy

    async def worker_urls(self) -> list[str]:
        return await asyncio.to_thread(self.engines.worker_urls)

    @contextlib.asynccontextmanager
    async def open_step(self, rollout, rollout_id: int, urls: list[str], in_flight_cap: int):
        args = self.args
        # groups accepted toward the target; off when stderr is not a terminal (logs stay clean)
        bar = None if args.rollout_mode == "stream" else tqdm(
            total=args.rollout_batch_size, desc=f"rollout {rollout_id}", unit="group", leave=False, disable=None)
        async with contextlib.nullcontext(self.session) if self.session is not None else aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=in_flight_cap + SESSION_EXTRA_CONNECTIONS)) as session:
            requester = SampleRequester(args, session, self.engines.router_url, sampling_params_from_args(args),
                                        rollout_id, rollout.served_version, agent=self.agent)
            async with EngineMonitors(args, self.engines, session, urls, bar) as monitors:
                yield StepIO(buffer=rollout.buffer, data_source=rollout.data_source, engines=self.engines,
                             requester=requester, generate=monitors.watchdog.explaining(rollout.requests(requester)),
                             reward=lambda samples: reward_group(args, expand_fanout(samples)),
                             filter=group_filter(args), session=session, watchdog=monitors.watchdog,
                             progress=bar.update if bar is not None else None)
            self.occupancy = monitors.metrics

    def step_metrics(self, record, io: StepIO) -> dict[str, float]:
        return step_metrics(self.args, record, io.requester, self.occupancy)

    async def evaluate(self, rollout_id: int, groups, version: int) -> RolloutOutput:
        return await generate_eval(self.args, rollout_id, groups, self.engines, version, self.agent)


__all__ = ["EngineLink", "GenerateState", "RolloutEngineFaultError", "RolloutError", "engine_rollout", "generate_rollout",
           "run_sync"]
