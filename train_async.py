"""Asynchronous RL training with APRIL partial rollouts: read this file top to bottom.

    setup → start the rollout (it runs ahead of the trainer, on its own thread)
          → for each step: take a batch → train → update weights in flight → eval → log → save

With `--rollout-mode chunked|pool` (one-step-off) the rollout of step k+1 (APRIL: over-sample, stop at the
target, abort, park, resume parked first) runs while the trainer trains on step k. With `--rollout-mode
stream` the engines keep `--rollout-pool-size` requests in flight across steps and a batch is the next
`--rollout-batch-size` accepted groups. Either way the rollout runs at most `--max-async-lag` versions
ahead of the trainer, the new weights reach the engines as soon as training ends (requests in flight are
aborted, wait, and resume from their tokens under the new version, so every token keeps the version that
produced it), and a checkpoint parks everything in flight first.

Engines and trainers need their own devices (`--colocate` is refused: rollout and training overlap), and
an engine fault stops the run with the engine named (`--use-fault-tolerance`'s restarts are train.py's).
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
from slime.ray.async_rollout import AsyncRollout  # noqa: E402
from slime.ray.train_loop import TrainingRun, is_due, train_or_stop  # noqa: E402
from slime.utils.graceful_stop import GracefulStop  # noqa: E402

logger = logging.getLogger("train")


def train(args, stop: GracefulStop | None = None) -> dict:
    # Checks, then engines + router + data + buffer, trainers; resumed from --load if it holds a checkpoint.
    # An error that ends the run shuts everything down and names what failed (slime/ray/train_loop.py).
    with TrainingRun(args, stop) as run:
        run.evaluate_start()
        rollout = AsyncRollout(args, run.rollout_manager, run.start_rollout_id).start()
        try:
            for rollout_id in tqdm(run.steps(), desc="rollout steps"):
                # 1. The next batch (the rollout produced it while the trainer trained on the previous ones).
                batch = rollout.next_batch(rollout_id)
                if batch is None:  # a stop request came while it waited: rollout.stop() below parks everything
                    break
                step_metrics = dict(batch.metrics)

                # 2. Train on it (off-policy tokens corrected against their behaviour log-probs); a batch where
                #    every group failed is skipped as in train.py, but still takes its version (one per batch).
                if run.trainable(rollout_id, batch):
                    step_metrics.update(run.train(rollout_id, batch))

                # 3. New policy version, pushed to the engines while requests are in flight (every
                #    --update-weights-interval steps): they wait at the gate (abort) or run on (in place) meanwhile.
                version = run.new_policy_version()
                eval_due = run.eval_due(rollout_id)
                if (is_due(rollout_id, args.update_weights_interval) or eval_due) and not run.stop.requested:
                    with rollout.updating_weights(version) as flush_cache:
                        step_metrics.update(run.push_weights(rollout_id, version, flush_cache))

                # 4. Eval, with the rollout paused (it shares the engines).
                if eval_due:
                    with rollout.paused("eval"):
                        step_metrics.update(run.evaluate(rollout_id))
                run.log(rollout_id, step_metrics)

                # 5. Save, with everything in flight parked in the buffer first (after the step's row is logged).
                if run.save_due(rollout_id):
                    with rollout.quiesced(resume=not run.is_last(rollout_id)):
                        run.save(rollout_id)
                if run.stop_due(rollout_id):  # SIGTERM, SIGINT, --exit-duration-in-mins, --exit-interval
                    break
        finally:
            rollout.stop()  # parks whatever is still in flight
        return run.finish()  # after a stop: checkpoint the last step done, shut down, say why (exit 128 + signal)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv, entry="train_async.py")
    except ArgumentError as e:
        print(f"train_async.py: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run is not None:  # checks the whole command line, prints the plan, starts nothing
        return dry_run("train_async.py", args)
    with GracefulStop(args.exit_duration_in_mins) as stop:  # SIGTERM / SIGINT: stop at the next safe point
        return train_or_stop("train_async.py", functools.partial(train, stop=stop), args)


if __name__ == "__main__":
    sys.exit(main())
