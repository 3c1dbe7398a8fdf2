"""The pieces train.py and train_async.py share: checks, set-up, resume, a training step, the weight push,
checkpoints, eval, logging and the entry points' error handling.

    with TrainingRun(args) as run:   # checks, run dir, logging, Ray, engines + buffer, trainers, resume
        run.evaluate_start()
        for rollout_id in run.steps():
            batch = run.rollout(rollout_id)                    # or train_async.py's rollout running ahead
            if batch is None: break                            # a stop halted it (its samples parked)
            if run.trainable(rollout_id, batch):               # not a step where every group failed
                with run.phases.train():                       # --colocate: who holds the devices
                    metrics |= run.train(rollout_id, batch)
                with run.phases.weight_sync():
                    metrics |= run.push_weights(rollout_id, run.new_policy_version())
            if run.eval_due(rollout_id): metrics |= run.evaluate(rollout_id)
            run.log(rollout_id, metrics)
            if run.save_due(rollout_id): run.save(rollout_id)
            if run.stop_due(rollout_id): break                   # SIGTERM, SIGINT, --exit-*
        run.finish()                                             # (a stop: checkpoint, shut down, say why)

A requested stop checkpoints and raises `StoppedOnRequest`; an error leaves as `RunStopped` (docs/faults.md)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable

from slime.backends.sglang_utils.watchdog import EngineFaultError
from slime.ray.actor_group import RayTrainGroup
from slime.ray.colocation import device_phases
from slime.ray.placement_group import create_placement_groups, write_placement
from slime.ray.restarts import PARTS
from slime.ray.rollout import EngineRestartsExhausted, RolloutManager
from slime.ray.run_faults import STOPS, RunRecord, RunStopped, TrainerRecovery, explain, explain_stop, train_or_stop
from slime.ray.step_timing import StepTiming
from slime.rollout.base_types import RolloutOutput
from slime.utils import checkpoint as ckpts
from slime.utils.empty_steps import EmptySteps, count_trainable
from slime.utils.gpu_plan import effective_settings
from slime.utils.graceful_stop import GracefulStop, StopNow, StoppedOnRequest
from slime.utils.hf_dir import check_hf_checkpoint
from slime.utils.metrics import MetricsLogger, truncate_run_logs
from slime.utils.run import init_ray, resolve_run_dir, setup_logging
from slime.utils.summary import log_run_summary

logger = logging.getLogger("train")

AT_ONCE_S = 5.0  # a second stop signal: how long trainer ranks get to release their weight-update group


def is_due(rollout_id: int, interval: int | None) -> bool:
    return bool(interval) and (rollout_id + 1) % interval == 0


class TrainingRun:
    def __init__(self, args, stop: GracefulStop | None = None):
        """`stop`: the entry point's (its signal handlers installed); None: only --exit-interval stops early."""
        self.args = args
        self.stop = stop if stop is not None else GracefulStop()
        self.run_dir = resolve_run_dir(args)
        setup_logging(self.run_dir)
        logger.info("%s", effective_settings(args))  # precision, optimizer sharding, offload
        self.actor_model, self.rollout_manager = None, None
        self.record = RunRecord(args.save)  # what a failure lost and what --load restores (run_faults.py)
        self.recovery: TrainerRecovery | None = None
        ckpt, state = self._check_inputs()
        try:
            self._start(ckpt, state)
        except BaseException as e:
            self._stop(e)

    def _start(self, ckpt, state) -> None:
        args = self.args
        init_ray(listen_host=args.listen_host)
        self.stop.install()  # again: ray.init puts its own SIGTERM handler in
        self.metrics = MetricsLogger(args, self.run_dir)
        # Engines + router + data + buffer on one side, trainers on the other.
        pgs = create_placement_groups(args)
        # each engine's host actor on its bundles (colocated: the trainers' bundles)
        self.rollout_manager = RolloutManager(args, self.run_dir, start_engines=not args.debug_train_only,
                                              engine_slots=pgs.engine_slots(args.num_engines,
                                                                            args.rollout_num_gpus_per_engine),
                                              halt=self.stop)
        if not args.debug_rollout_only:
            if args.use_fault_tolerance:  # a trainer that fails starts again; the engines stay up
                self.recovery = TrainerRecovery(args, self.rollout_manager.restarts, self.rollout_manager.engines)
            self.actor_model = RayTrainGroup(args, pgs, recover=self.recovery).init()
            if self.recovery is not None:
                self.recovery.trainer = self.actor_model
        # who runs where: RUN_DIR/placement.json
        write_placement(self.run_dir, pgs, self.actor_model, self.rollout_manager.engines)
        self.start_rollout_id = self._resume(ckpt, state)
        self.record.step = self.start_rollout_id
        # --colocate: who holds the shared devices in each phase (engines release, the trainer onloads, ...)
        self.phases = device_phases(args, self.actor_model, self.rollout_manager.engines)
        self.empty_steps = EmptySteps(args.max_consecutive_empty_steps)
        self.timing = StepTiming(self.rollout_manager.engines)  # the `perf/` metrics of each step

    def _name_actors(self) -> None:
        """The buffer's and trainer ranks' actors by role, so a death names the part (after a restart: the new ones)."""
        if self.rollout_manager is not None:
            self.record.actors[self.rollout_manager.buffer_actor._actor_id.hex()] = "the buffer actor"
        if self.actor_model is not None:
            for rank, (actor, pid) in enumerate(zip(self.actor_model.actors, self.actor_model.pids)):
                self.record.actors[actor._actor_id.hex()] = f"trainer rank {rank} (pid {pid})"

    # ---- a failure ends the run -------------------------------------------------------------
    def __enter__(self) -> "TrainingRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        at_once = self.stop.at_once  # a second stop signal: everything down, then it says where the run was
        if isinstance(exc, KeyboardInterrupt) and at_once is not None:
            self.shutdown_quietly(at_once=True)
            raise StopNow(f"{at_once}; stopped in step {self.record.step}: {self.record.resume_hint()}",
                          at_once.exit_code) from None
        if isinstance(exc, Exception) and not isinstance(exc, StoppedOnRequest):
            self._stop(exc)
        elif exc is not None:  # Ctrl-C without our handlers: everything down, then it goes on up
            self.shutdown_quietly()
        return False

    def _stop(self, error: BaseException):
        """Shut every part down, then raise `RunStopped` naming what failed (Ctrl-C: re-raised as it is)."""
        if not isinstance(error, Exception):
            self.shutdown_quietly()
            raise error
        self._name_actors()
        reason = explain(error, self.record, names_itself=isinstance(error, STOPS))
        self.shutdown_quietly()
        raise RunStopped(reason) from error

    def shutdown_quietly(self, at_once: bool = False) -> None:
        try:
            self.shutdown(at_once)
        except Exception as e:  # noqa: BLE001 - the run's own error is the one to report
            logger.warning("shutting down after the failure: %s: %s", type(e).__name__, e)

    @property
    def num_rollout(self) -> int:
        return self.rollout_manager.num_rollout

    def steps(self) -> range:
        """The rollout ids still to run (the per-step clock starts here)."""
        self.timing.restart()
        return range(self.start_rollout_id, self.num_rollout)

    def is_last(self, rollout_id: int) -> bool:
        return rollout_id + 1 == self.num_rollout

    # ---- checks and resume ----------------------------------------------------------------
    def _check_inputs(self):
        """Before anything starts: the model dir, a writable --save with room, an intact checkpoint to resume
        (and the data contract it was saved under). Returns (checkpoint dir or None, its driver state)."""
        args = self.args
        check_hf_checkpoint(args.hf_checkpoint)
        if args.ref_load and ckpts.model_dir_of(args.ref_load) is None:  # else a torch_dist one, read by the trainer
            check_hf_checkpoint(args.ref_load, "--ref-load", need_tokenizer=False)
        if args.save:
            ckpts.prepare_save_dir(args.save, 0 if args.debug_rollout_only else ckpts.checkpoint_size_estimate(args.hf_checkpoint))
        self.foreign = self._foreign_load()
        ckpt = ckpts.resolve_checkpoint(args.load, args.ckpt_step) if args.load and self.foreign is None else None
        state = ckpts.read_driver_state(ckpt) if ckpt is not None else None
        if state is not None:
            ckpts.check_data_contract(state.get("contract"), args)
            truncate_run_logs(self.run_dir, state["rollout_id"])  # the steps after the checkpoint are re-run
        return ckpt, state

    def _foreign_load(self):
        """`--load` of a Megatron checkpoint train.py did not write: megatron starts from its weights."""
        args = self.args
        if not args.load or args.train_backend != "megatron" or ckpts.model_only_checkpoint(args.load) is None:
            return None
        from slime.backends.megatron_utils.checkpoint import foreign_checkpoint

        found = foreign_checkpoint(args.load)
        if args.ckpt_step is not None:
            raise ckpts.CheckpointLoadError(f"--ckpt-step picks one of train.py's checkpoints; {args.load} holds "
                                            f"{found.model_dir}, which --load resumes without it")
        logger.info("--load %s holds %s, not a train.py checkpoint (upstream slime's or a converter's): resuming its "
                    "weights at rollout %d; its optimizer state, the buffer, the ledger and the data position start "
                    "fresh", args.load, os.path.basename(found.model_dir), found.start_rollout)
        return found

    def _resume(self, ckpt, state) -> int:
        """Trainer state, data position, parked groups + ledger, policy version, RNG; the first rollout id."""
        manager = self.rollout_manager
        if self.foreign is not None:  # the trainer started from its weights; the engines get them
            if self.actor_model is not None and manager.engines is not None:
                manager.push_weights(self.actor_model, manager.policy_version)
            return self.foreign.start_rollout
        if ckpt is None:
            return 0
        if self.recovery is not None:
            self.recovery.checkpointed(f"{ckpt}/trainer")
        if self.actor_model is not None:
            self.actor_model.load(f"{ckpt}/trainer")
        manager.load_state_dict(state["rollout"])
        manager.load_buffer(f"{ckpt}/buffer")
        ckpts.set_rng_state(state["rng"])
        start = state["rollout_id"] + 1
        self.record.checkpoint, self.record.policy_version = state["rollout_id"], manager.policy_version
        self.record.at_checkpoint = self.record.ledger = manager.ledger_summary()
        logger.info("resumed from %s at rollout %d (policy version %d)", ckpt, start, manager.policy_version)
        if self.actor_model is not None and manager.engines is not None:
            manager.push_weights(self.actor_model, manager.policy_version)
        return start

    def evaluate_start(self) -> None:
        """The starting point's eval (fresh runs only; not with --skip-eval-before-train)."""
        if (self.rollout_manager.eval_sets and self.args.eval_interval and self.start_rollout_id == 0
                and not self.args.skip_eval_before_train):
            self.metrics.log(-1, self.rollout_manager.evaluate(rollout_id=-1))

    # ---- one step ------------------------------------------------------------------------
    def rollout(self, rollout_id: int) -> RolloutOutput | None:
        """The step's batch (an engine fault named, or restarted and run again); None when a stop halted it."""
        if self.stop.requested:
            return None
        out = self._surviving_engine_faults(lambda: self.rollout_manager.generate(rollout_id))
        return None if "rollout/halted" in out.metrics else out

    def _surviving_engine_faults(self, step: Callable[[], Any]) -> Any:
        manager = self.rollout_manager
        while True:
            try:
                return step()
            except EngineFaultError as e:
                # raises without --use-fault-tolerance, or out of restarts; a restarted router keeps the weights
                if manager.restart_engines(e) and self.actor_model is not None:
                    manager.push_weights(self.actor_model, manager.policy_version)
                    logger.info("pushed policy version %d to the restarted engines", manager.policy_version)

    def trainable(self, rollout_id: int, rollout: RolloutOutput) -> bool:
        """Anything to train: a trainer (not --debug-rollout-only), a group not failed (else counted, N stop)."""
        if self.actor_model is None:
            return False
        if count_trainable(rollout.groups) == 0:
            self.empty_steps.skipped(rollout_id, rollout.dropped)
            return False
        self.empty_steps.trained()
        return True

    def train(self, rollout_id: int, rollout: RolloutOutput) -> dict[str, float]:
        """Train on the batch (off-policy tokens corrected against their behaviour log-probs); mark it trained."""
        t0 = time.monotonic()
        version = self.rollout_manager.policy_version
        # --use-fault-tolerance: the batch stays in the object store until the next checkpoint (for a replay)
        batch = self.recovery.batch(rollout.groups) if self.recovery is not None else rollout.groups
        out = self.actor_model.train(rollout_id, batch, version)
        if self.recovery is not None:
            self.recovery.trained(rollout_id, batch, version)
        self.timing.trainer_busy += time.monotonic() - t0
        if not self.args.load_debug_rollout_data:
            self.rollout_manager.mark_trained(rollout.groups)
        return {f"train/{k}": v for k, v in out.items()}

    def new_policy_version(self) -> int:
        """The trainer's weights after this step's update: the next policy version (what a restarted engine gets)."""
        manager = self.rollout_manager
        manager.set_policy_version(manager.policy_version + 1)
        self.record.policy_version = manager.policy_version
        return manager.policy_version

    def push_weights(self, rollout_id: int, version: int, flush_cache: bool | None = None) -> dict[str, float]:
        """The trainer's weights to every engine as `version` (a failing engine named, or restarted)."""
        manager = self.rollout_manager
        if manager.engines is None or self.actor_model is None or self.stop.requested:
            return {}  # (a stop: the engines are about to go; a --load pushes the checkpoint's weights)
        t0 = time.monotonic()
        try:
            with self.checkpoint_if_engines_give_up(rollout_id):
                sync = manager.push_weights(self.actor_model, version, flush_cache)
        finally:
            self.timing.trainer_busy += time.monotonic() - t0
        return {f"weight_sync/{k}": v for k, v in sync.items()}

    @contextlib.contextmanager
    def checkpoint_if_engines_give_up(self, rollout_id: int):
        """Engines that keep failing stop the run: checkpoint `rollout_id` first, so `--load` resumes it."""
        try:
            yield
        except EngineRestartsExhausted:
            if self.args.save and rollout_id >= 0:
                self.save(rollout_id)
            raise

    # ---- checkpoints and eval -------------------------------------------------------------------
    def save_due(self, rollout_id: int) -> bool:
        """--save every --save-interval steps, and after the last one (a stop's checkpoint is `finish`'s)."""
        return (bool(self.args.save) and not self.stop_due(rollout_id)
                and (self.is_last(rollout_id) or is_due(rollout_id, self.args.save_interval)))

    def stop_due(self, rollout_id: int) -> bool:
        """Stop after this step: a stop was requested, or --exit-interval says so (`finish` checkpoints)."""
        if is_due(rollout_id, self.args.exit_interval) and not self.is_last(rollout_id):
            self.stop.request(f"--exit-interval {self.args.exit_interval}: step {rollout_id} done")
        return self.stop.requested

    def save(self, rollout_id: int) -> str:
        manager = self.rollout_manager
        writers = {"buffer": manager.save_buffer}
        if self.actor_model is not None:
            writers["trainer"] = self.actor_model.save
        path = ckpts.save_checkpoint(self.args.save, rollout_id, writers,
                                     {"rollout_id": rollout_id, "rollout": manager.state_dict(),
                                      "rng": ckpts.rng_state(), "contract": ckpts.data_contract(self.args)})
        if self.recovery is not None:
            self.recovery.checkpointed(f"{path}/trainer")
        manager.buffer_checkpointed(path)
        self.record.checkpoint, self.record.at_checkpoint = rollout_id, manager.ledger_summary()
        return path

    def eval_due(self, rollout_id: int) -> bool:
        return (bool(self.rollout_manager.eval_sets) and is_due(rollout_id, self.args.eval_interval)
                and not self.stop.requested)

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        """Eval sets on the engines' current weights (never enters the buffer, never trains)."""
        t0 = time.monotonic()
        out = self._surviving_engine_faults(lambda: self.rollout_manager.evaluate(rollout_id))
        out["perf/eval_time_s"] = time.monotonic() - t0
        return out

    def log(self, rollout_id: int, step_metrics: dict) -> None:
        """Empty steps, ledger counts, restarts, colocation costs and `perf/` timings, then one metrics record."""
        step_metrics.update(self.phases.metrics())
        step_metrics.update(self.timing.metrics())  # (the next step's clock starts)
        step_metrics["train/skipped_empty_steps"] = float(self.empty_steps.total)
        self.record.ledger = self.rollout_manager.ledger_summary()
        step_metrics.update({f"ledger/{k}": v for k, v in self.record.ledger.items()})
        # restarts so far, read now: one during this step's training or weight push (after its batch was made) counts
        step_metrics.update(self.rollout_manager.restarts.metrics())
        self.metrics.log(rollout_id, step_metrics)
        self.record.step = rollout_id + 1  # a failure from here on is in the next step

    def finish(self) -> dict:
        if self.stop.requested:
            self._finish_stopped()
        manager = self.rollout_manager  # restarts counted to the end: one after the last row is in no row
        summary = log_run_summary(self.run_dir, self.metrics.path, self.args,
                                  restarts={p: manager.restarts.counts[p] for p in PARTS} if manager else None)
        self.metrics.close()
        self.shutdown()
        return summary

    def _finish_stopped(self) -> None:
        """A requested stop: checkpoint the last step done (everything in flight is parked by now), shut every part
        and Ray down, then raise `StoppedOnRequest` naming why, the checkpoint and what `--load` resumes."""
        done, path, held = self.record.step - 1, None, None
        if self.args.save and done >= 0:
            path = self.save(done)
            held = self.rollout_manager.buffer_sizes()
        self.metrics.close()
        self.shutdown()
        import ray

        ray.shutdown()
        raise StoppedOnRequest(explain_stop(self.stop.reason, self.record, path, held), self.stop.exit_code)

    def shutdown(self, at_once: bool = False) -> None:
        """Trainers, engines, router. `at_once`: trainer ranks still busy with a call are killed after a moment."""
        if self.actor_model is not None:
            self.actor_model.shutdown(**({"timeout": AT_ONCE_S} if at_once else {}))  # releases the weight-update group
            self.actor_model = None
        if self.rollout_manager is not None:
            self.rollout_manager.shutdown()


__all__ = ["STOPS", "RunStopped", "TrainingRun", "is_due", "train_or_stop"]
