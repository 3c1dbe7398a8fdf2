"""RL training with APRIL partial rollouts: read this file top to bottom.

    setup → for each step: rollout → train → update weights → save → eval

`train_async.py` is the same loop with the rollout running ahead of the trainer; the pieces both use
(set-up, resume, training step, weight push, checkpoints, eval, logging) are in slime/ray/train_loop.py.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from slime.arguments import ArgumentError, parse_args
from slime.ray.train_loop import TrainingRun

logger = logging.getLogger("train")


def train(args) -> dict:
    # Engines + router + data + buffer, trainers; resumed from --load if it holds a checkpoint.
    run = TrainingRun(args)
    run.evaluate_start()

    for rollout_id in tqdm(run.steps(), desc="rollout steps"):
        # 1. Rollout (APRIL: over-sample, stop at the target, abort, park the rest).
        if args.colocate and run.actor_model is not None:
            run.actor_model.offload()  # the engines get the shared devices
        rollout = run.rollout_manager.generate(rollout_id)
        step_metrics = dict(rollout.metrics)

        if run.actor_model is not None:
            if args.colocate:
                run.actor_model.onload()
            # 2. Train on the finished groups (off-policy tokens corrected against their behaviour log-probs).
            step_metrics.update(run.train(rollout_id, rollout))
            # 3. New policy version to every engine.
            step_metrics.update(run.update_weights())

        # 4. Save (every --save-interval steps, and after the last one).
        if run.save_due(rollout_id):
            run.save(rollout_id)

        # 5. Eval (never enters the buffer, never trains).
        if run.eval_due(rollout_id):
            step_metrics.update(run.evaluate(rollout_id))

        run.log(rollout_id, step_metrics)

    return run.finish()


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
