"""Rewards: `async_rm`, `batched_async_rm` and `reward_group` (never raises). Dispatch as slime's:
`--custom-rm-path`, else the sample's `metadata["rm_type"]`, else `--rm-type`; every reward bounded by
`--reward-timeout`."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers

from slime.rollout.rm_hub.dapo import compute_score_dapo, compute_score_dapo_answer
from slime.rollout.rm_hub.deepscaler import get_deepscaler_rule_based_reward, grade_answer, grade_answer_verl
from slime.rollout.rm_hub.math_utils import extract_answer, extract_boxed_answer
from slime.rollout.rm_hub.math_verify_reward import math_verify_reward
from slime.rollout.rm_hub.remote_rm import remote_rm
from slime.rollout.rm_hub.threads import run_in_daemon_thread
from slime.utils.misc import load_function
from slime.utils.plugin_args import plugin_args
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)

RM_TYPES = ("deepscaler", "dapo", "math", "remote_rm", "subtract_chain")
BOXED_PREFIX = "boxed_"
INLINE_RM_TYPES = frozenset({"deepscaler", "dapo"})

__all__ = ["async_rm", "batched_async_rm", "reward_group", "reward_timeout", "RM_TYPES", "extract_answer",
           "extract_boxed_answer", "get_deepscaler_rule_based_reward", "grade_answer_verl"]


def reward_timeout(args) -> float | None:
    """`--reward-timeout` in seconds, None when unlimited (<= 0)."""
    t = args.reward_timeout
    return None if t is None or float(t) <= 0 else float(t)


def _to_number(value, source: str) -> float:
    """A finite float from a number (int, float, numpy or 0-d tensor scalar); bool counts as 0/1."""
    if not isinstance(value, (str, bytes, dict)) and (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        reward = float(value)
        if math.isfinite(reward):
            return reward
    raise TypeError(f"reward from {source} must be a finite number, got {type(value).__name__} {str(value)[:80]!r}")


def _to_reward(value, source: str, reward_key: str | None = None) -> float | dict:
    """A number, or with `--reward-key` a dict whose field `reward_key` is a finite number (the dict is kept)."""
    if isinstance(value, dict):
        if reward_key is None:
            raise TypeError(f"reward from {source} is a dict (keys {sorted(map(str, value))[:10]}); pass --reward-key "
                            "to say which field is the reward")
        if reward_key not in value:
            raise KeyError(f"reward from {source} has no field {reward_key!r} (--reward-key); it has "
                           f"{sorted(map(str, value))[:10]}")
        return {**value, reward_key: _to_number(value[reward_key], f"{source} (field {reward_key!r})")}
    return _to_number(value, source)


class RewardCancelledError(RuntimeError):
    """A reward plugin raised CancelledError itself (not the step cancelling it)."""


def _rm_type(args, sample: Sample) -> str:
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    return str(metadata.get("rm_type") or args.rm_type or "").strip()


def _run_plugin(fn, *call_args):
    """Runs in a daemon thread: the plugin, its coroutine (if any) on a fresh event loop of its own."""
    try:
        result = fn(*call_args)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return result
    except asyncio.CancelledError as e:  # would look like the caller being cancelled on the other side
        raise RewardCancelledError(f"the reward plugin raised CancelledError{f': {e}' if str(e) else ''}") from None


async def _awaited(awaitable):
    return await awaitable


async def _call_plugin(fn, timeout: float | None, *call_args):
    """A user plugin (sync or async) in a daemon thread: a blocking one cannot freeze the rollout's loop."""
    return await run_in_daemon_thread(_run_plugin, fn, *call_args, timeout=timeout)


def _resolve(args, sample: Sample) -> tuple[str, str, str, bool]:
    """(requested type, base type, response to score, answer only) for a sample without a custom reward."""
    requested = _rm_type(args, sample)
    if not requested:
        raise ValueError(f"no reward configured: set --rm-type (one of {', '.join(RM_TYPES)}, or boxed_<type>) or --custom-rm-path")
    if requested.startswith(BOXED_PREFIX):
        return requested, requested[len(BOXED_PREFIX) :], extract_boxed_answer(sample.response) or "", True
    return requested, requested, sample.response, False


def _inline_reward(rm_type: str, response: str, label, answer_only: bool) -> float:
    """deepscaler / dapo: pure string and arithmetic checks, bounded by construction (see math_expr)."""
    if rm_type == "deepscaler":
        if answer_only:
            return 1.0 if response and grade_answer(response, label) else 0.0
        return get_deepscaler_rule_based_reward(response, label)
    return compute_score_dapo_answer(response, label) if answer_only else compute_score_dapo(response, label)


async def _dispatch(args, sample: Sample, timeout: float | None) -> float:
    custom = args.custom_rm_path
    if custom:
        return _to_reward(await _call_plugin(load_function(custom), timeout, plugin_args(args), sample),
                          f"--custom-rm-path {custom}",
                          args.reward_key)

    requested, rm_type, response, answer_only = _resolve(args, sample)
    label = sample.label
    if rm_type in INLINE_RM_TYPES:
        return _inline_reward(rm_type, response, label, answer_only)
    if rm_type == "math":
        return await math_verify_reward(response, label, timeout, answer_only=answer_only)
    if rm_type == "remote_rm":
        return await remote_rm(args, sample, timeout=timeout, response=response if answer_only else None)
    if rm_type == "subtract_chain":
        from slime.tasks.subtract_chain import compute_reward  # written alongside; imported only when used

        return _to_number(compute_reward(response, label), "subtract_chain")
    raise ValueError(
        f"unknown --rm-type {requested!r}: expected one of {', '.join(RM_TYPES)}, "
        f"a '{BOXED_PREFIX}<type>' of those, or a --custom-rm-path"
    )


async def async_rm(args, sample: Sample) -> float | dict:
    """The reward of one sample; raises on error, TimeoutError after `--reward-timeout` seconds."""
    timeout = reward_timeout(args)
    if not args.custom_rm_path:
        _, rm_type, response, answer_only = _resolve(args, sample)
        if rm_type in INLINE_RM_TYPES:  # no task, no timer: microseconds each, bounded anyway
            return _inline_reward(rm_type, response, sample.label, answer_only)
    try:
        return await asyncio.wait_for(_dispatch(args, sample, timeout), timeout)
    except TimeoutError as e:
        raise TimeoutError(f"no reward within {timeout}s (--reward-timeout)") from e


async def batched_async_rm(args, samples: list[Sample]) -> list[float]:
    """Rewards of a group (one call with `--group-rm`, else per sample); raises on the first error."""
    custom = args.custom_rm_path
    if custom and args.group_rm:
        return await _group_call(args, samples, custom)
    return list(await asyncio.gather(*(async_rm(args, s) for s in samples)))


async def _group_call(args, samples: list[Sample], custom: str) -> list[float]:
    timeout = reward_timeout(args)
    try:
        rewards = await asyncio.wait_for(_call_plugin(load_function(custom), timeout, plugin_args(args), samples),
                                         timeout)
    except TimeoutError as e:
        raise TimeoutError(f"no group reward within {timeout}s (--reward-timeout)") from e
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise ValueError(f"--custom-rm-path {custom} with --group-rm must return {len(samples)} rewards, got {got}")
    return [_to_reward(r, f"--custom-rm-path {custom}", args.reward_key) for r in rewards]


def _mark_failed(sample: Sample, error: BaseException) -> None:
    sample.reward = None
    sample.status = Status.FAILED
    sample.metadata["failure"] = f"reward: {type(error).__name__}: {error}"
    logger.warning("reward failed for sample %s (group %s): %s", sample.index, sample.group_index, sample.metadata["failure"])


async def reward_group(args, samples: list[Sample]) -> None:
    """Set `reward` on every sample of a group, never raising: a reward error fails its sample. FAILED samples are
    skipped, and (as upstream) so are rewarded ones, unless --group-rm."""
    todo = [s for s in samples if s.status != Status.FAILED]
    custom = args.custom_rm_path
    if not args.group_rm:
        for s in [s for s in todo if s.reward is not None]:
            todo.remove(s)
            try:
                s.reward = _to_reward(s.reward, "the reward set by --custom-generate-function-path", args.reward_key)
            except (TypeError, KeyError) as e:
                _mark_failed(s, e)
    if not todo:
        return
    if custom and args.group_rm:
        try:
            rewards = await _group_call(args, todo, custom)
        except Exception as e:
            for s in todo:
                _mark_failed(s, e)
            return
        for s, r in zip(todo, rewards):
            s.reward = r
        return
    results = await asyncio.gather(*(async_rm(args, s) for s in todo), return_exceptions=True)
    for s, r in zip(todo, results):
        if isinstance(r, asyncio.CancelledError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise r  # we are being cancelled (the step stopped waiting): let it through
            r = RewardCancelledError("the reward raised CancelledError")  # a reward's own: fail that sample
        if isinstance(r, BaseException):
            _mark_failed(s, r)
        else:
            s.reward = r
