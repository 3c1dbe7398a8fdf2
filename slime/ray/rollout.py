"""RolloutManager: owns the engines + router, the data source, the buffer actor and the rollout function, in the
driver process. A step that loses an engine raises `EngineFaultError` (its samples parked); with
`--use-fault-tolerance` the driver has it restarted (`restart_engines`) and the step run again."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

from slime.backends.sglang_utils.process_utils import ServerLaunchError
from slime.backends.sglang_utils.watchdog import EngineFault, EngineFaultError, ProcessWatch
from slime.ray.buffer import RestartableBuffer, start_buffer
from slime.ray.restarts import TOGETHER, RestartBudget
from slime.rollout.base_types import RolloutOutput, eval_output_metrics, to_rollout_output
from slime.rollout.buffer import call_sync
from slime.rollout.multi_turn import ToolAgent
from slime.rollout.multi_turn.metrics import tool_metrics
from slime.rollout.rollout import Rollout, RolloutContext
from slime.rollout.sampling_request import args_with_router
from slime.rollout.sglang_rollout import engine_rollout
from slime.utils.eval_scores import write_eval_scores
from slime.utils.gc_utils import freeze_gc_heap
from slime.utils.ledger import TRAINED, group_id
from slime.utils.misc import load_function, run_sync
from slime.utils.plugin_args import plugin_args
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

# how long to look for an engine fault behind a failed broadcast before blaming the trainer
FAULT_CONFIRM_S = 5.0


def _faults_within(watch: ProcessWatch, seconds: float) -> list[EngineFault]:
    """Every fault the watch knows, looking up to `seconds` for one: its own thread may record it first (then
    `check()` finds nothing new), e.g. a router that died before the sync and failed its first call at once."""
    deadline = time.monotonic() + seconds
    while True:
        watch.check()
        if watch.faults or time.monotonic() >= deadline:
            return list(watch.faults.values())
        time.sleep(0.1)


class EngineRestartsExhausted(EngineFaultError):
    """Engines kept failing after --max-engine-restarts restarts; the message names them."""


def group_reward_metrics(groups: list[list[Sample]], prefix: str, reward_key: str | None = None) -> dict[str, float]:
    """Mean reward and accuracy (reward > 0) over the rewarded samples of `groups` (dict rewards: `reward_key`)."""
    rewards = [r for g in groups for s in g if s.status is not Status.FAILED
               and (r := s.scalar_reward(reward_key)) is not None]
    failed = sum(1 for g in groups for s in g if s.status is Status.FAILED)
    lengths = [s.response_length for g in groups for s in g]
    out = {f"{prefix}/failed_samples": float(failed)}
    if rewards:
        out[f"{prefix}/mean"] = sum(rewards) / len(rewards)
        out[f"{prefix}/accuracy"] = sum(1 for r in rewards if r > 0) / len(rewards)
    if lengths:
        out[f"{prefix}/response_len_mean"] = sum(lengths) / len(lengths)
    return out


class RolloutManager:
    def __init__(self, args, run_dir: str, start_engines: bool = True, engine_slots=None, halt=None):
        """`engine_slots`: each engine's bundles (None: engines in this process); `halt`: the stop request."""
        from transformers import AutoTokenizer

        from slime.rollout.data_source import RolloutDataSource, load_eval_groups

        self.args = args
        self.run_dir = run_dir
        self.halt = halt
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.engines = None
        self.plugin_args = plugin_args(args)  # what plugins get (writable); the router's address once engines attach
        self.data_source = RolloutDataSource(args, self.tokenizer) if args.prompt_data else None
        self.eval_sets = {
            name: load_eval_groups(args, self.tokenizer, name, path, args.n_samples_per_eval_prompt)
            for name, path in args.eval_datasets
        }
        self.restarts = RestartBudget(args.max_engine_restarts)  # engines, the router, the trainer and the buffer
        # --use-fault-tolerance: a handle that starts the actor again from the newest checkpoint, replaying since
        self.buffer = RestartableBuffer(args, self.restarts) if args.use_fault_tolerance else start_buffer(args)
        self._record_dropped_rows()
        self.rollout_fn = load_function(args.rollout_function_path)
        self.eval_fn = load_function(args.eval_function_path) if args.eval_function_path else self.rollout_fn
        # --agent-env: the multi-turn agent (its tool workers) lives as long as this manager (closed at shutdown)
        self.agent = ToolAgent.from_args(args, self.tokenizer) if args.agent_env else None
        self.rollout: Rollout | None = None  # the run's rollout (slime/rollout/rollout.py), over the engines
        engines = None
        if start_engines:
            from slime.backends.sglang_utils.engine_group import EngineGroup

            engines = EngineGroup(args, log_dir=os.path.join(run_dir, "engine_logs"), slots=engine_slots).start()
        self.attach_engines(engines)
        # the rollout runs here: keep the start-up heap out of full collections (each stalls every request)
        freeze_gc_heap("rollout manager")

    # ---- steps --------------------------------------------------------------
    @property
    def num_rollout(self) -> int:
        """`--num-rollout`, or `--num-epoch` worth of steps over the prompt data."""
        if self.args.num_rollout is not None:
            return self.args.num_rollout
        return max(1, self.args.num_epoch * len(self.data_source) // self.args.rollout_batch_size)

    def attach_engines(self, engines) -> None:
        """The engines (None: --debug-train-only) and the run's `Rollout` over them; plugins see the router's
        address in `args.sglang_router_ip` / `args.sglang_router_port`, as upstream's do."""
        planner = None  # --over-sampling-batch-size auto: its planner (the simulator it runs is imported only then)
        if self.args.over_sampling_batch_size == "auto":
            from slime.rollout.simulator.planner import OverSamplingPlanner

            planner = OverSamplingPlanner.from_args(self.args)
        version = self.rollout.version if self.rollout is not None else 0
        self.engines = engines
        self.rollout = engine_rollout(self.args, self.buffer, self.data_source, engines, self.agent, planner, version)
        if engines is not None:
            self.plugin_args = args_with_router(self.args, engines.router_url)

    @property
    def policy_version(self) -> int:
        return self.rollout.version

    def call_rollout_fn(self, rollout_id: int, ctx: RolloutContext) -> RolloutOutput:
        """One training step of the rollout function, and the groups it took settled in the ledger."""
        where = f"--rollout-function-path {self.args.rollout_function_path}"
        result = self.rollout_fn(self.plugin_args, rollout_id, ctx, evaluation=False)
        out = to_rollout_output(result, where, ctx.policy_version)
        out.dropped.update(ctx.settle_issued(out.groups))
        return out

    def generate(self, rollout_id: int) -> RolloutOutput:
        if self.args.load_debug_rollout_data:
            return self._load_debug(rollout_id)
        return self.finish_batch(rollout_id, self.call_rollout_fn(rollout_id, self.rollout.context(halt=self.halt)))

    def finish_batch(self, rollout_id: int, out: RolloutOutput) -> RolloutOutput:
        """A batch about to be trained (from `generate` or train_async.py's rollout): reward and data metrics,
        debug dump. (Restart counts are the step's row's, read as it is written: a restart can come later.)"""
        out.metrics.update(group_reward_metrics(out.groups, "reward", self.args.reward_key))
        if self.data_source is not None:
            out.metrics.update({f"data/dropped_rows/{k}": float(v) for k, v in self.data_source.dropped_rows.items()})
        if self.args.save_debug_rollout_data:
            self._save_debug(rollout_id, out)
        return out

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        where = f"--eval-function-path {self.args.eval_function_path or self.args.rollout_function_path}"
        for name, groups in self.eval_sets.items():
            def run(groups=groups):
                fresh = [[Sample.from_dict(s.to_dict()) for s in g] for g in groups]  # never reuse generated state
                return self.eval_fn(self.plugin_args, rollout_id, self.rollout.context(eval_groups=fresh), evaluation=True)

            out = run()
            if isinstance(out, RolloutOutput):
                metrics.update(group_reward_metrics(out.groups, f"eval/{name}", self.args.reward_key))
                write_eval_scores(self.run_dir, rollout_id, name, out.groups, self.args.reward_key)  # paired gains
                metrics.update(tool_metrics([s for g in out.groups for s in g], f"eval/{name}/"))  # multi-turn only
            else:  # upstream's RolloutFnEvalOutput (or its dict), keyed by the function's own set names
                metrics.update(eval_output_metrics(out, where, self.args.reward_key))
        accs = [v for k, v in metrics.items() if k.endswith("/accuracy")]
        if accs:
            metrics["eval/accuracy"] = sum(accs) / len(accs)
        return metrics

    # ---- engine faults and the weight push ------------------------------------------
    def push_weights(self, trainer, version: int, flush_cache: bool | None = None) -> dict[str, float]:
        """Push the trainer's weights to every engine through the Rollout's `updating_weights` (or inside it:
        `flush_cache` given); an engine that dies meanwhile is killed at once, so the broadcast fails now."""
        if flush_cache is None:
            async def update():
                async with self.rollout.updating_weights(version) as flush:
                    return await asyncio.to_thread(self.push_weights, trainer, version, flush)

            return run_sync(update())
        while True:
            with ProcessWatch(self.engines, on_fault=self.kill_faulty) as watch:
                try:
                    return trainer.update_weights(self.engines, version, flush_cache)
                except Exception as e:  # noqa: BLE001 - an engine fault is named; anything else re-raised
                    faults = list(watch.faults.values()) or _faults_within(watch, FAULT_CONFIRM_S)
                    if not faults:
                        raise
                    error = EngineFaultError(f"weight sync to version {version}: "
                                             + "; ".join(f.describe() for f in faults) + f" ({type(e).__name__}: {e})",
                                             faults)
                    error.__cause__ = e
            self.restart_engines(error)  # then the loop pushes `version` to the fresh engines

    def kill_faulty(self, fault: EngineFault) -> None:
        if fault.rank is not None:
            self.engines.faults.kill_engine(fault.rank)

    def restart_engines(self, error: EngineFaultError) -> list[int]:
        """Restart the failed engines (and the router first, if it failed); returns the restarted ranks. Raises
        when --use-fault-tolerance is off or the restart budget is spent."""
        if not self.args.use_fault_tolerance:
            raise EngineFaultError(f"{error} (--use-fault-tolerance would restart "
                                   f"{'it' if len(error.faults) == 1 else 'them'})", error.faults) from error
        restarted = []
        for fault in sorted(error.faults, key=lambda f: not f.router):
            if fault.rank is None and not fault.router:
                raise EngineFaultError(f"{error}; {fault.url} was not launched by this run, so it cannot be restarted",
                                       error.faults) from error
            while True:
                if not self.restarts.spend("router" if fault.router else "engine"):
                    raise EngineRestartsExhausted(
                        f"{error}; giving up after {self.restarts.used} restart(s) (--max-engine-restarts "
                        f"{self.restarts.limit}: {TOGETHER})", error.faults) from error
                logger.warning("restart %s: %s", self.restarts.progress(), fault.describe())
                try:
                    if fault.router:
                        self.engines.faults.restart_router()
                    else:
                        self.engines.faults.restart_engine(fault.rank)
                        restarted.append(fault.rank)
                    break
                except ServerLaunchError as e:
                    logger.error("restarting %s failed: %s", "the router" if fault.router else f"engine {fault.rank}", e)
        return restarted

    def set_policy_version(self, version: int) -> None:
        self.rollout.version = int(version)

    def mark_trained(self, groups: list[list[Sample]]) -> None:
        ids = sorted(group_id(g) for g in groups)
        self._buffer("mark", ids, TRAINED)

    def ledger_summary(self) -> dict[str, int]:
        return self._buffer("ledger_summary")

    def buffer_sizes(self) -> dict[str, int]:
        """Groups the buffer holds now: parked (unfinished) and ready (finished, not yet trained)."""
        return {"parked": int(self._buffer("num_parked")), "ready": int(self._buffer("num_ready"))}

    # ---- checkpoints --------------------------------------------------------
    def save_buffer(self, path: str) -> None:
        self._buffer("save", os.path.join(path, "buffer.json"))

    def buffer_checkpointed(self, ckpt_dir: str) -> None:
        """A checkpoint is published: a restarted buffer actor starts from its buffer (--use-fault-tolerance)."""
        if isinstance(self.buffer, RestartableBuffer):
            self.buffer.checkpointed(os.path.join(ckpt_dir, "buffer", "buffer.json"))

    @property
    def buffer_actor(self):
        """The buffer's Ray actor now (--use-fault-tolerance: the newest its handle started)."""
        return self.buffer.actor if isinstance(self.buffer, RestartableBuffer) else self.buffer

    def load_buffer(self, path: str) -> None:
        self._buffer("load", os.path.join(path, "buffer.json"))
        self._record_dropped_rows()  # this load's drops (a resumed run may drop rows differently)

    def _record_dropped_rows(self) -> None:
        """The data rows dropped at load go into the ledger with their reasons, so an audit accounts for them."""
        if self.data_source is not None:
            self._buffer("drop_rows", self.data_source.dropped)

    def _buffer(self, method: str, *args):
        return call_sync(self.buffer, method, *args, timeout=self.args.rollout_rpc_timeout)

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy_version": self.policy_version,
            "data_source": self.data_source.state_dict() if self.data_source is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollout.version = int(state["policy_version"])
        if self.data_source is not None and state.get("data_source") is not None:
            self.data_source.load_state_dict(state["data_source"])

    def _save_debug(self, rollout_id: int, out: RolloutOutput) -> None:
        path = self.args.save_debug_rollout_data.format(rollout_id=rollout_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"rollout_id": rollout_id, "metrics": out.metrics,
                       "groups": [[s.to_dict() for s in g] for g in out.groups]}, f)
        logger.info("saved rollout %d to %s", rollout_id, path)

    def _load_debug(self, rollout_id: int) -> RolloutOutput:
        path = self.args.load_debug_rollout_data.format(rollout_id=rollout_id)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--load-debug-rollout-data: {path} (rollout {rollout_id}) does not exist")
        with open(path) as f:
            d = json.load(f)
        groups = [[Sample.from_dict(s) for s in g] for g in d["groups"]]
        return RolloutOutput(groups=groups, metrics={**d.get("metrics", {}),
                                                     **group_reward_metrics(groups, "reward", self.args.reward_key)})

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        if self.engines is not None:
            self.engines.shutdown()
            self.engines = None
