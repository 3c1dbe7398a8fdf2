"""When a part of the run fails: restart the trainer without the engines, and say what a failure lost.

`TrainerRecovery` (`--use-fault-tolerance`): a dead or out-of-memory trainer rank restarts every rank from the
newest checkpoint while the engines stay up, and the batches trained since are trained again in order
(docs/faults.md). `RunRecord` + `explain`: what the driver knows, so an error that ends the run names the part that
died and what `--load` restores; `train_or_stop` writes that line last in <run>/train.log."""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass, field
from typing import Callable

from slime.backends.sglang_utils.engine_api import UnsupportedEngineVersion
from slime.backends.sglang_utils.watchdog import EngineFaultError
from slime.ray.actor_group import TrainerRankError
from slime.ray.buffer import BufferReplayError, BufferRestartsExhausted
from slime.ray.placement_group import PlacementError
from slime.ray.restarts import TOGETHER
from slime.rollout.data_source import DataError
from slime.utils import checkpoint as ckpts
from slime.utils.empty_steps import EmptyStepsError
from slime.utils.graceful_stop import StopNow, StoppedOnRequest
from slime.utils.hf_dir import ModelDirError
from slime.utils.net import ListenHostError
from slime.utils.paths import PathNotVisibleError

logger = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """A run ended by an error: the message says why in one line (the part that failed, what it held, what
    `--load` restores); `__cause__` is the original error."""


class TrainerRestartsExhausted(RuntimeError):
    """The trainer kept failing after the restart budget was spent."""


# errors that name their cause (flag, file, engine, trainer rank, reward): one line, no traceback
STOPS = (ckpts.CheckpointLoadError, ckpts.CheckpointSaveError, ModelDirError, DataError, EngineFaultError,
         EmptyStepsError, PlacementError, PathNotVisibleError, ListenHostError, UnsupportedEngineVersion,
         TrainerRankError, TrainerRestartsExhausted, BufferRestartsExhausted, BufferReplayError)


def train_or_stop(entry: str, train: Callable, args) -> int:
    """Run `train(args)`; whatever error ends it is written last in <run>/train.log and on stderr, exit code 1
    (docs/faults.md); a requested stop ends the same way with its own line and exit code 128 + the signal."""
    log = logging.getLogger("train")
    try:
        train(args)
    except StoppedOnRequest as e:
        log.warning("stopped: %s", e)
        print(f"{entry}: stopped: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # a second stop signal (StopNow), or Ctrl-C where our handlers are not installed
        reason = str(e) if isinstance(e, StopNow) else "interrupted"
        log.error("stopped: %s", reason)
        print(f"{entry}: stopped: {reason}", file=sys.stderr)
        return e.exit_code if isinstance(e, StopNow) else 128 + signal.SIGINT
    except Exception as e:
        root = e.__cause__ if isinstance(e, RunStopped) and e.__cause__ is not None else e
        if isinstance(root, STOPS):
            log.debug("stopped", exc_info=root)
        else:  # not named by its own message: where it came from is worth the traceback
            log.error("the run failed with an unexpected error", exc_info=root)
        for line in reversed(cause_lines(e)):  # the innermost first: the reason is the last line
            log.error("because of %s", line)
        reason = str(e).strip() if isinstance(e, (RunStopped,) + STOPS) else f"{type(e).__name__}: {str(e).strip()}"
        log.error("stopped: %s", reason)
        print(f"{entry}: error: {reason.splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


@dataclass
class RunRecord:
    save: str | None  # --save
    step: int | None = None  # the step running (None before the first)
    checkpoint: int | None = None  # the newest checkpoint's step (saved or loaded)
    at_checkpoint: dict = field(default_factory=dict)  # the ledger's counts when it was written
    ledger: dict = field(default_factory=dict)  # the ledger's counts after the last logged step
    policy_version: int = 0
    actors: dict[str, str] = field(default_factory=dict)  # Ray actor id (hex) -> its role, e.g. "trainer rank 0"

    def resume_hint(self) -> str:
        if not self.save:
            return "nothing to resume from (--save is not set)"
        if self.checkpoint is None:
            return f"no checkpoint in {self.save} yet: a new run starts at step 0"
        return f"`--load {self.save}` resumes at step {self.checkpoint + 1} (checkpoint iter_{self.checkpoint:07d})"

    def held(self, role: str) -> str:
        """What the actor with `role` held, and what the newest checkpoint has of it."""
        ckpt = f"iter_{self.checkpoint:07d}" if self.checkpoint is not None else None
        if role == "the buffer actor":
            now = (f"{self.ledger.get('parked', 0)} parked and {self.ledger.get('finished', 0)} ready groups after "
                   f"the last step" if self.ledger else "the groups of the first step")
            there = (f"; checkpoint {ckpt} holds {self.at_checkpoint.get('parked', 0)} parked and "
                     f"{self.at_checkpoint.get('finished', 0)} ready groups and the ledger of step {self.checkpoint}"
                     if ckpt else "")
            return f"it held the ledger of every group and {now}{there}"
        if role.startswith("trainer rank"):
            there = f"; checkpoint {ckpt} holds those of step {self.checkpoint}" if ckpt else ""
            return f"it held the weights and optimizer state of policy version {self.policy_version}{there}"
        return ""


def explain_stop(reason: str, record: RunRecord, checkpoint: str | None, held: dict | None) -> str:
    """The line a requested stop ends with: why, the last step done, the checkpoint written (and the groups its
    buffer holds) and what `--load` resumes."""
    done = record.step - 1
    if done < 0:
        return f"{reason}; stopped in step 0, before anything was trained: nothing to checkpoint, a new run starts at step 0"
    if checkpoint is None:
        return f"{reason}; stopped after step {done}: {record.resume_hint()}"
    return (f"{reason}; stopped after step {done} (everything in flight parked): saved checkpoint {checkpoint} "
            f"({held['parked']} parked and {held['ready']} ready groups in its buffer); `--load {record.save}` "
            f"resumes at step {done + 1}")


def _chain(error: BaseException):
    """`error` and its explicit causes (`raise ... from`); an implicit context is often an unrelated error
    handled on the way (the traceback of an unexpected error shows it)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__


def dead_actor(error: BaseException):
    """The first Ray actor death (RayActorError) in `error`'s cause chain, or None."""
    import ray

    return next((e for e in _chain(error) if isinstance(e, ray.exceptions.RayActorError)), None)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def explain(error: BaseException, record: RunRecord, names_itself: bool) -> str:
    """The one line a run that ends with `error` stops with. `names_itself`: the error's own message names its
    cause (a flag, file, engine, reward); otherwise its type leads."""
    reason = first_line(error) if names_itself else f"{type(error).__name__}: {first_line(error)}"
    died = dead_actor(error)
    if died is not None:
        role = record.actors.get(died.actor_id or "", "a Ray actor")
        held = record.held(role)
        what = f"{role} died ({type(died).__name__})" + (f": {held}" if held else "")
        reason = what if died is error else f"{reason}; {what}"
    where = f"stopped in step {record.step}" if record.step is not None else "stopped while starting"
    return f"{reason}; {where}: {record.resume_hint()}"


def cause_lines(error: BaseException) -> list[str]:
    """Each error in the cause chain below `error`, as `Type: message`; one whose message the error above it
    already carries (a wrapper that adds to it) is left out."""
    out, above = [], str(error)
    for e in list(_chain(error))[1:]:
        text = str(e).strip()
        if text and text not in above:
            out.append(f"{type(e).__name__}: {text}")
        above = text or above
    return out


class TrainerRecovery:
    """The `recover` hook of a RayTrainGroup (see the module docstring). `trained` after each training call,
    `checkpointed` after each checkpoint (or a resume from one)."""

    def __init__(self, args, budget, engines):
        self.args, self.budget, self.engines = args, budget, engines
        self.trainer = None  # the RayTrainGroup, set once made
        self.checkpoint: str | None = None  # the trainer directory of the newest checkpoint
        self.replay: list[tuple[int, object, int]] = []  # (rollout id, ObjectRef of its groups, policy version)
        if not args.save:
            logger.warning("--use-fault-tolerance without --save: a restarted trainer starts from the run's first "
                           "weights and replays every step, kept in Ray's object store for the whole run")

    def batch(self, groups):
        """The step's groups in the object store (trained from there; kept until the next checkpoint)."""
        import ray

        return ray.put(groups)

    def trained(self, rollout_id: int, batch, policy_version: int) -> None:
        self.replay.append((rollout_id, batch, policy_version))

    def checkpointed(self, trainer_dir: str) -> None:
        self.checkpoint = trainer_dir
        self.replay.clear()

    def __call__(self, error) -> None:
        trainer = self.trainer
        trainer.recover = None  # a failure during the recovery is this loop's to handle, not a nested one's
        try:
            while True:
                if not self.budget.spend("trainer"):
                    raise TrainerRestartsExhausted(
                        f"{error}; giving up after {self.budget.used} restart(s) (--max-engine-restarts "
                        f"{self.budget.limit}: {TOGETHER})") from error
                steps = [rid for rid, _, _ in self.replay]
                logger.warning("restart %s: %s; the trainer starts again from %s and replays %d step(s) %s trained "
                               "since (the engines and the router stay up)", self.budget.progress(), error,
                               self.checkpoint or "the weights it started the run with", len(steps), steps)
                try:
                    self._restart()
                    return
                except Exception as e:  # noqa: BLE001 - counted and tried again, or raised when the budget is spent
                    logger.error("restarting the trainer failed: %s", e)
                    error = e
        finally:
            trainer.recover = self

    def _restart(self) -> None:
        trainer = self.trainer
        trainer.restart()
        self._forget_weight_sync()
        if self.checkpoint is not None:
            trainer.load(self.checkpoint)
        for rollout_id, batch, version in self.replay:
            trainer.train(rollout_id, batch, version)
        logger.warning("trainer restarted (pids %s) from %s; replayed steps %s", trainer.pids,
                       self.checkpoint or "the weights it started the run with",
                       [rid for rid, _, _ in self.replay] or "none")

    def _forget_weight_sync(self) -> None:
        """The engines drop the weight-update group they shared with the dead trainer (distributed mode), so the
        new one can form it again under the same name."""
        if self.engines is None or self.args.update_weight_mode != "distributed":
            return
        try:
            push = self.engines.weights
            push.wait(push.destroy_group(timeout=60.0), "POST /destroy_weights_update_group", timeout=65.0)
        except Exception as e:  # noqa: BLE001 - an engine that has no group (yet) is fine
            logger.warning("engines: dropping the old trainer's weight-update group: %s", e)
