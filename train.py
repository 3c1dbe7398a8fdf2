"""RL training with APRIL partial rollouts: read this file top to bottom.

    setup → for each step: rollout → train → update weights → save → eval
"""

from __future__ import annotations

import contextlib
import logging
import sys

from slime.utils.run import set_offline_defaults

set_offline_defaults()  # before anything imports Ray: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (loopback node) at import

from tqdm import trange  # noqa: E402

from slime.arguments import ArgumentError, parse_args  # noqa: E402
from slime.backends.sglang_utils.watchdog import EngineFaultError  # noqa: E402
from slime.ray.actor_group import RayTrainGroup  # noqa: E402
from slime.ray.colocation import device_phases  # noqa: E402
from slime.ray.placement_group import PlacementError, create_placement_groups, write_placement  # noqa: E402
from slime.ray.rollout import EngineRestartsExhausted, RolloutManager  # noqa: E402
from slime.rollout.data_source import DataError  # noqa: E402
from slime.utils import checkpoint as ckpts  # noqa: E402
from slime.utils.empty_steps import EmptySteps, EmptyStepsError, count_trainable  # noqa: E402
from slime.utils.hf_dir import ModelDirError, check_hf_checkpoint  # noqa: E402
from slime.utils.metrics import MetricsLogger, truncate_run_logs  # noqa: E402
from slime.utils.net import ListenHostError  # noqa: E402
from slime.utils.paths import PathNotVisibleError  # noqa: E402
from slime.utils.run import init_ray, resolve_run_dir, setup_logging  # noqa: E402
from slime.utils.summary import log_run_summary  # noqa: E402

logger = logging.getLogger("train")


def _is_due(rollout_id: int, interval: int | None) -> bool:
    return bool(interval) and (rollout_id + 1) % interval == 0


def _save(args, rollout_id: int, rollout_manager, actor_model) -> None:
    writers = {"buffer": rollout_manager.save_buffer}
    if actor_model is not None:
        writers["trainer"] = actor_model.save
    ckpts.save_checkpoint(args.save, rollout_id, writers,
                          {"rollout_id": rollout_id, "rollout": rollout_manager.state_dict(),
                           "rng": ckpts.rng_state(), "contract": ckpts.data_contract(args)})


@contextlib.contextmanager
def _checkpoint_if_engines_give_up(args, rollout_id: int, rollout_manager, actor_model):
    """Engines that keep failing stop the run: checkpoint what it reached (`rollout_id`, parked samples
    included) first, so `--load` resumes it."""
    try:
        yield
    except EngineRestartsExhausted:
        if args.save and rollout_id >= 0:
            _save(args, rollout_id, rollout_manager, actor_model)
        raise


def train(args) -> dict:
    run_dir = resolve_run_dir(args)
    setup_logging(run_dir)
    # Checks before anything starts: the model dir, a writable --save with room, an intact checkpoint to resume.
    check_hf_checkpoint(args.hf_checkpoint)
    if args.ref_load:
        check_hf_checkpoint(args.ref_load, "--ref-load", need_tokenizer=False)
    if args.save:
        ckpts.prepare_save_dir(args.save, 0 if args.debug_rollout_only else ckpts.checkpoint_size_estimate(args.hf_checkpoint))
    ckpt = ckpts.resolve_checkpoint(args.load, args.ckpt_step) if args.load else None
    state = ckpts.read_driver_state(ckpt) if ckpt is not None else None
    if state is not None:
        ckpts.check_data_contract(state.get("contract"), args)
        truncate_run_logs(run_dir, state["rollout_id"])  # the steps after the checkpoint are re-run
    init_ray(listen_host=args.listen_host)
    metrics = MetricsLogger(args, run_dir)

    # Engines + router + data + buffer on one side, trainers on the other.
    pgs = create_placement_groups(args)
    rollout_manager = RolloutManager(args, run_dir, start_engines=not args.debug_train_only,
                                     engine_slots=pgs.engine_slots(args.num_engines, args.rollout_num_gpus_per_engine))
    actor_model = None if args.debug_rollout_only else RayTrainGroup(args, pgs).init()
    if actor_model is not None:
        rollout_manager.attach_weight_sync(actor_model.update_weights)  # a restarted engine gets the current weights
    write_placement(run_dir, pgs, actor_model, rollout_manager.engines)  # who runs where: RUN_DIR/placement.json

    # Resume: trainer state, data position, parked groups + ledger, policy version, RNG.
    start_rollout_id = 0
    if ckpt is not None:
        if actor_model is not None:
            actor_model.load(f"{ckpt}/trainer")
        rollout_manager.load_state_dict(state["rollout"])
        rollout_manager.load_buffer(f"{ckpt}/buffer")
        ckpts.set_rng_state(state["rng"])
        start_rollout_id = state["rollout_id"] + 1
        logger.info("resumed from %s at rollout %d (policy version %d)", ckpt, start_rollout_id, rollout_manager.policy_version)
    if ckpt is not None and actor_model is not None and rollout_manager.engines is not None:
        rollout_manager.sync_weights(rollout_manager.policy_version)

    if rollout_manager.eval_sets and args.eval_interval and start_rollout_id == 0:
        metrics.log(-1, rollout_manager.evaluate(rollout_id=-1))  # the starting point

    empty_steps = EmptySteps(args.max_consecutive_empty_steps)
    # --colocate: who holds the shared devices in each phase (engines release, the trainer onloads, ...)
    phases = device_phases(args, actor_model, rollout_manager.engines)
    for rollout_id in trange(start_rollout_id, rollout_manager.num_rollout, desc="rollout steps"):
        # 1. Rollout (APRIL: over-sample, stop at the target, abort, park the rest).
        with phases.rollout(), _checkpoint_if_engines_give_up(args, rollout_id - 1, rollout_manager, actor_model):
            rollout = rollout_manager.generate(rollout_id)
        step_metrics = dict(rollout.metrics)

        if actor_model is not None and count_trainable(rollout.groups) == 0:
            # 2'. Nothing to train on (every group failed): no update, no version bump; stops after N in a row.
            empty_steps.skipped(rollout_id, rollout.dropped)
        elif actor_model is not None:
            empty_steps.trained()
            # 2. Train on the finished groups (off-policy tokens corrected against their behaviour log-probs).
            with phases.train():
                train_metrics = actor_model.train(rollout_id, rollout.groups, rollout_manager.policy_version)
            step_metrics.update({f"train/{k}": v for k, v in train_metrics.items()})
            if not args.load_debug_rollout_data:
                rollout_manager.mark_trained(rollout.groups)

            # 3. New policy version to every engine (one that fails meanwhile is named, or restarted).
            new_version = rollout_manager.policy_version + 1
            rollout_manager.set_policy_version(new_version)
            with phases.weight_sync():
                if rollout_manager.engines is not None:
                    with _checkpoint_if_engines_give_up(args, rollout_id, rollout_manager, actor_model):
                        sync_metrics = rollout_manager.sync_weights(new_version)
                    step_metrics.update({f"weight_sync/{k}": v for k, v in sync_metrics.items()})
            step_metrics.update(phases.metrics())
        step_metrics["train/skipped_empty_steps"] = float(empty_steps.total)

        # 4. Save (every --save-interval steps, and after the last one).
        last_step = rollout_id + 1 == rollout_manager.num_rollout
        if args.save and (last_step or _is_due(rollout_id, args.save_interval)):
            _save(args, rollout_id, rollout_manager, actor_model)

        # 5. Eval (never enters the buffer, never trains).
        if rollout_manager.eval_sets and _is_due(rollout_id, args.eval_interval):
            step_metrics.update(rollout_manager.evaluate(rollout_id))

        step_metrics.update({f"ledger/{k}": v for k, v in rollout_manager.ledger_summary().items()})
        metrics.log(rollout_id, step_metrics)

    summary = log_run_summary(run_dir, metrics.path, args)
    metrics.close()
    if actor_model is not None:
        actor_model.shutdown()  # releases the weight-update group on both sides
    rollout_manager.shutdown()
    return summary


# errors that name their cause (flag, file, engine, reward): one line, no traceback
STOPS = (ckpts.CheckpointLoadError, ckpts.CheckpointSaveError, ModelDirError, DataError, EngineFaultError,
         EmptyStepsError, PlacementError, PathNotVisibleError, ListenHostError)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    try:
        train(args)
    except STOPS as e:
        logger.debug("stopped", exc_info=True)
        logger.error("stopped: %s", e)
        print(f"train.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
