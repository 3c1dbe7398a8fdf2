"""Upstream slime's `GenerateState` (`from slime.rollout.sglang_rollout import GenerateState`), for plugins.

One object per process with upstream's fields (`tokenizer`, `processor`, `semaphore`, `sampling_params`);
`.aborted` is true once the running step aborts the engines, so a multi-turn generate can return ABORTED."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import Any

from slime.rollout.sampling_request import sampling_params_from_args, step_stopping
from slime.utils.misc import SingletonMeta


class _PerCheckpoint(SingletonMeta):
    """One instance per process, remade when a call names another `--hf-checkpoint`."""

    def __call__(cls, args):
        current = cls.__dict__.get("_singleton_instance")
        if current is not None and current.args.hf_checkpoint != args.hf_checkpoint:
            cls.clear_instances()
        return super().__call__(args)


class GenerateState(metaclass=_PerCheckpoint):
    def __init__(self, args) -> None:
        from transformers import AutoTokenizer

        self.args = args
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
        self.processor = None  # multimodal processors are not supported: text models only
        self.concurrency = int(args.sglang_server_concurrency) * int(args.num_engines)
        self.sampling_params: dict[str, Any] = dict(sampling_params_from_args(args),
                                                    max_new_tokens=int(args.rollout_max_response_len),
                                                    spaces_between_special_tokens=False)
        self.dp_counts = [0]
        self.dp_rank = 0
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.reset()

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """The running event loop's semaphore of `concurrency` slots."""
        loop = asyncio.get_running_loop()
        sem = self._semaphores.get(loop)
        if sem is None:
            sem = self._semaphores[loop] = asyncio.Semaphore(self.concurrency)
        return sem

    @property
    def aborted(self) -> bool:
        """Whether the rollout step the calling generate runs for is aborting (sampling_request.in_step)."""
        return step_stopping()

    @aborted.setter
    def aborted(self, value) -> None:
        raise AttributeError("GenerateState.aborted is set by the rollout step, which aborts the engines itself "
                             "once it has its batch; a plugin only reads it")

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set = set()

    @contextlib.contextmanager
    def dp_rank_context(self):
        """Upstream balances requests over an engine's data-parallel ranks; engines here have one (rank 0)."""
        self.dp_counts[0] += 1
        try:
            yield 0
        finally:
            self.dp_counts[0] -= 1
