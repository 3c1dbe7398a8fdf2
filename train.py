"""RL training with APRIL partial rollouts: read this file top to bottom.

    setup → for each step: rollout → train → update weights → eval → log → save

`train_async.py` is the same loop with the rollout running ahead of the trainer; the pieces both use
(checks, set-up, resume, training step, weight push, checkpoints, eval, logging) are in
slime/ray/train_loop.py. With --colocate, `run.phases` hands the shared devices back and forth
(slime/ray/colocation.py); without it its phases do nothing.
"""

from __future__ import annotations

import functools
import logging
import sys

from slime.utils.run import set_offline_defaults

set_offline_defaults()  # before anything imports Ray: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (loopback node) at import

from tqdm import tqdm  # noqa: E402

from slime.arguments import ArgumentError, parse_args  # noqa: E402
from slime.dry_run import dry_run  # noqa: E402
from slime.ray.train_loop import TrainingRun, train_or_stop  # noqa: E402
from slime.utils.graceful_stop import GracefulStop  # noqa: E402

logger = logging.getLogger("train")


def train(args, stop: GracefulStop | None = None) -> dict:
    # Checks, then engines + router + data + buffer, trainers; resumed from --load if it holds a checkpoint.
    # An error that ends the run shuts everything down and names what failed (slime/ray/train_loop.py).
    with TrainingRun(args, stop) as run:
        run.evaluate_start()

        for rollout_id in tqdm(run.steps(), desc="rollout steps"):
            # 1. Rollout (APRIL: over-sample, stop at the target, abort, park the rest).
            with run.phases.rollout(), run.checkpoint_if_engines_give_up(rollout_id - 1):
                rollout = run.rollout(rollout_id)
            if rollout is None:  # a stop request halted it (its samples parked, none lost): finish() checkpoints
                break
            step_metrics = dict(rollout.metrics)

            # 2'. Nothing to train on (every group failed): no update, no version bump; stops after N in a row.
            if run.trainable(rollout_id, rollout):
                # 2. Train on the finished groups (off-policy tokens corrected against their behaviour log-probs).
                with run.phases.train():
                    step_metrics.update(run.train(rollout_id, rollout))
                # 3. New policy version to every engine (one that fails meanwhile is named, or restarted).
                with run.phases.weight_sync():
                    step_metrics.update(run.push_weights(rollout_id, run.new_policy_version()))

            # 4. Eval (never enters the buffer, never trains).
            if run.eval_due(rollout_id):
                step_metrics.update(run.evaluate(rollout_id))
            run.log(rollout_id, step_metrics)

            # 5. Save (every --save-interval steps, and after the last one), after the step's metrics are logged:
            #    a checkpoint of step k always has step k's row (a resume drops the rows after its checkpoint).
            if run.save_due(rollout_id):
                run.save(rollout_id)
            if run.stop_due(rollout_id):  # SIGTERM, SIGINT, --exit-duration-in-mins, --exit-interval
                break

        return run.finish()  # after a stop: checkpoint the last step done, shut down, say why (exit 128 + signal)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run is not None:  # checks the whole command line, prints the plan, starts nothing
        return dry_run("train.py", args)
    with GracefulStop(args.exit_duration_in_mins) as stop:  # SIGTERM / SIGINT: stop at the next safe point
        return train_or_stop("train.py", functools.partial(train, stop=stop), args)


if __name__ == "__main__":
    sys.exit(main())
