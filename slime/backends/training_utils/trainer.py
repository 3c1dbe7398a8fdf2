"""The trainer skeleton both backends extend (FSDP2 and Megatron-core): one instance per trainer rank. Every
public method that touches the model is a collective: call it on every rank. Per `train` call: drop FAILED
samples, compute old (when needed: loss.py) and reference log-probs, advantages and TIS weights, then run
len(samples) / --global-batch-size optimizer steps over this rank's micro-batches. A backend supplies its model
set-up, its forward, its gradient bookkeeping and its data-parallel group.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from slime.backends.training_utils.data import (MicroBatch, TrainItem, build_micro_batch, dummy_item, flatten_groups,
                                                plan_micro_batches, rollout_tokens, split_steps)
from slime.backends.training_utils.distributed import device, open_master_port, use_cuda
from slime.backends.training_utils.loss import (RolloutTensors, behaviour_metrics, compute_rollout_tensors,
                                                loss_inputs, micro_batch_loss, old_log_probs_needed)
from slime.backends.training_utils.offload import DeviceOffloader, Offloadable
from slime.backends.training_utils.weight_sync.feed import EngineFeed
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


def metric_keys(args) -> list[str]:
    """The per-step loss metrics every backend reports (summed over micro-batches and DP ranks)."""
    if args.loss_type == "sft_loss":
        return ["sft_loss", "loss"]
    keys = ["pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "loss"]
    keys += ["pg_dual_clipfrac"] if args.eps_clip_c is not None else []
    return keys + (["kl_loss"] if args.use_kl_loss else [])


def read_metrics(parts: dict[str, torch.Tensor], keys: list[str]) -> list[float]:
    """`keys`' values from `parts` (0-dim tensors, all on one device; a missing key is 0) in one read."""
    if not parts:
        return [0.0] * len(keys)
    zero = torch.zeros((), dtype=torch.float32, device=next(iter(parts.values())).device)
    return torch.stack([parts[k].float() if k in parts else zero for k in keys]).tolist()


class Trainer(Offloadable):
    backend = "base"

    def __init__(self, args, rank: int = 0, world_size: int = 1):
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.optimizer = None
        self.updater = None
        self.pad_id = 0
        self._owns_pg = False
        self.offloader = DeviceOffloader(f"{self.backend} trainer rank {rank}")
        self._master_sock = None

    # ---------------------------------------------------- backend's part ----
    # A backend defines `_setup(master_addr, master_port, listen_sock) -> init info`, `_forward(model, mb,
    # with_entropy, entropy_grad) -> (log-probs [R], entropies or None, a tensor depending on every parameter
    # used)`, `_set_train_mode`, `_zero_grads`, `_optimizer_step() -> grad norm`, the model handles `_actor` /
    # `_ref`, `_dp() -> (data-parallel rank, size)`, `_state_tensors`, `_save` / `_load` / `_export_hf`,
    # `_release` and `_destroy_groups`; the hooks below have defaults.
    def _finish_grads(self) -> None:
        """After a step's last backward: the gradient reductions the backward did not do itself."""

    def _before_backward(self, last: bool) -> None:
        """Before each micro-batch's backward; `last`: the optimizer step's last one."""

    def _seq_multiple(self) -> int:
        """Micro-batch lengths must be a multiple of this (sequence parallelism)."""
        return 1

    def _dp_groups(self) -> tuple:
        """(the data-parallel group, its gloo twin for pickled objects); None: the default group."""
        return None, None

    def _dp_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device())  # NCCL on a GPU needs device tensors
        dist.all_reduce(t, group=self._dp_groups()[0])
        return t.tolist()

    def _dp_max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._dp_groups()[0])
        return int(t.item())

    def _dp_gather(self, obj) -> list:
        out: list = [None] * self._dp()[1]
        dist.all_gather_object(out, obj, group=self._dp_groups()[1])
        return out

    # ------------------------------------------------------------ set-up ----
    def open_master_port(self) -> tuple[str, int]:
        """Rank 0: open the store's listening socket now (kept for `init`); returns (address, port)."""
        self._master_sock, address, port = open_master_port(self.args.listen_host)
        return address, port

    def init(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict:
        torch.set_num_threads(int(self.args.train_num_threads))
        if master_port is None and self.world_size != 1:
            raise ValueError(f"{type(self).__name__}.init: master_port is required when world_size > 1")
        sock, self._master_sock = self._master_sock, None
        return self._setup(master_addr, master_port or 0, sock)

    # ----------------------------------------------------------- helpers ----
    @property
    def temperature(self) -> float:
        t = float(self.args.rollout_temperature)
        return t if t > 0 else 1.0  # greedy rollouts: log-probs of the raw logits

    @property
    def packed(self) -> bool:
        return self.args.micro_batch_layout == "packed"

    def _plan(self, items: list[TrainItem]) -> list[list[TrainItem]]:
        """This rank's micro-batches, padded with empty ones to the count of the rank that has most (every rank
        runs the same number of forward passes)."""
        args = self.args
        dp_rank, dp_size = self._dp()
        max_tokens = args.max_tokens_per_gpu if args.use_dynamic_batch_size else None
        mine = plan_micro_batches(items, dp_size, int(args.micro_batch_size), max_tokens, args.balance_data)[dp_rank]
        n = self._dp_max(len(mine)) if dp_size > 1 else len(mine)
        return mine + [[] for _ in range(n - len(mine))]

    def _micro_batch(self, items: list[TrainItem]) -> MicroBatch:
        return build_micro_batch(items or [dummy_item(self.pad_id)], self.pad_id, self.packed, device(),
                                 self._seq_multiple())

    @torch.no_grad()
    def _log_probs(self, model, items: list[TrainItem]) -> list[torch.Tensor]:
        """Response log-probs of every item (every rank gets all of them), read back from the device once."""
        self._set_train_mode(model, False)
        try:
            mine, flat = [], []
            for mb_items in self._plan(items):  # an empty one (a dummy item) keeps the collectives in step
                lp = self._forward(model, self._micro_batch(mb_items))[0]
                if mb_items:
                    mine += mb_items
                    flat.append(lp.detach().float())
        finally:
            if model is self._actor:
                self._set_train_mode(model, True)
        return self._gather_log_probs(mine, flat, len(items))

    def _gather_log_probs(self, mine: list[TrainItem], flat: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        """Every rank's log-probs of its items `mine` (`flat`: flat over their response tokens), gathered on every
        rank into one list by item position."""
        local = []
        if flat:
            host = torch.cat(flat).cpu().split([it.response_len for it in mine])
            local = [(it.pos, lp.clone()) for it, lp in zip(mine, host)]  # (own storage: pickled to other ranks)
        out: list[torch.Tensor | None] = [None] * n
        for part in (self._dp_gather(local) if self._dp()[1] > 1 else [local]):
            for pos, lp in part:
                out[pos] = lp
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------- train ----
    def train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int = 0) -> dict[str, float]:
        with self.on_device("train"):
            return self._train(rollout_id, groups, policy_version)

    def _train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        items, rt, metrics = self._prepare(groups, old_forward=None)
        if not items:
            logger.warning("rollout %d: no trainable samples (%d failed); skipping the update", rollout_id,
                           int(metrics["num_failed_excluded"]))
            return metrics
        metrics["old_logprob_time_s"] = time.perf_counter() - t0
        metrics["old_logprob_forward"] = float(rt.old_log_probs is not None)  # 0: the update's forward gave them
        steps = split_steps([it.rollout for it in items], int(self.args.global_batch_size))
        sums: dict[str, float] = defaultdict(float)
        seen: tuple[list, list] | None = ([], []) if rt.old_log_probs is None else None
        for positions in steps:
            for k, v in self._train_step([items[p] for p in positions], rt, seen).items():
                sums[k] += v
        metrics.update({k: v / len(steps) for k, v in sums.items()})
        if seen is not None:  # the old log-probs were the update's forward: the metrics that need them, now
            old = self._gather_log_probs(seen[0], seen[1], len(items))
            metrics.update(behaviour_metrics(self.args, items, old, rt.ref_log_probs)[0])
        metrics["num_optimizer_steps"] = float(len(steps))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["train_time_s"] = time.perf_counter() - t0
        logger.info("rollout %d (policy v%d): %d samples, %d steps, loss %.4g, grad_norm %.4g", rollout_id,
                    policy_version, len(items), len(steps), metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0))
        return metrics

    def _prepare(self, groups: list[list[Sample]], old_forward: bool | None = True
                 ) -> tuple[list[TrainItem], RolloutTensors | None, dict]:
        """Samples → items, old / reference log-probs, advantages and TIS weights. `old_forward`: whether the old
        log-probs get a forward of their own (None: when `old_log_probs_needed`)."""
        item_groups, n_failed = flatten_groups(groups, self.args.reward_key)
        items = [it for g in item_groups for it in g]
        metrics: dict[str, float] = {"num_samples": float(len(items)), "num_failed_excluded": float(n_failed),
                                     "num_tokens": float(sum(it.num_tokens for it in items))}
        if not items:
            return items, None, metrics
        if old_forward is None:
            steps = split_steps([it.rollout for it in items], int(self.args.global_batch_size))
            old_forward = old_log_probs_needed(self.args, len(steps))
        old = self._log_probs(self._actor, items) if old_forward else None
        ref = self._log_probs(self._ref, items) if self._ref is not None else None
        rt = compute_rollout_tensors(self.args, item_groups, old, ref)
        metrics.update(rt.metrics)
        return items, rt, metrics

    def _train_step(self, step_items: list[TrainItem], rt: RolloutTensors, seen: tuple[list, list] | None = None
                    ) -> dict[str, float]:
        parts = self._accumulate_grads(step_items, rt, seen)
        grad_norm = self._optimizer_step()
        keys = metric_keys(self.args)
        values = read_metrics(parts, keys)  # the step's one read of the loss metrics from the device
        out = dict(zip(keys, self._dp_sum(values) if self._dp()[1] > 1 else values))
        out["grad_norm"] = float(grad_norm)
        return out

    def _accumulate_grads(self, step_items: list[TrainItem], rt: RolloutTensors, seen: tuple[list, list] | None = None
                          ) -> dict[str, torch.Tensor]:
        """Forward / backward over this rank's micro-batches of one optimizer step (nothing waits for the device);
        returns this rank's metric parts. `seen` (items, log-probs): where the micro-batches' items and detached
        log-probs are appended (the old ones, when `rt` has none)."""
        args = self.args
        per_rollout = rollout_tokens(step_items)  # a sample-mean loss averages each rollout once
        num_tokens, num_samples = float(sum(per_rollout.values())), float(len(per_rollout))
        dp_size = self._dp()[1]
        self._zero_grads()
        parts: dict[str, torch.Tensor] = {}
        plan = self._plan(step_items)
        for i, mb_items in enumerate(plan):
            mb = self._micro_batch(mb_items)
            if mb_items:
                inp = loss_inputs(args, rt, [it.pos for it in mb_items], [it.loss_mask for it in mb_items],
                                  num_tokens, num_samples, device(), [per_rollout[it.rollout] for it in mb_items],
                                  [it.rollout_log_probs for it in mb_items])
                lps, ents, _ = self._forward(self._actor, mb, with_entropy=True,
                                             entropy_grad=float(args.entropy_coef) != 0.0)
                if seen is not None:
                    seen[0].extend(mb_items)
                    seen[1].append(lps.detach().float())
                loss, m = micro_batch_loss(args, lps, ents, inp)
                m["loss"] = loss.detach()
                for key, v in m.items():
                    parts[key] = parts[key] + v if key in parts else v
            else:  # this rank ran out of data: a no-op pass keeps the collectives in step
                _, _, keep = self._forward(self._actor, mb)
                loss = keep.sum() * 0.0
            # gradients are averaged over DP ranks; the loss is already a global mean
            self._before_backward(i == len(plan) - 1)
            (loss * dp_size).backward()
        self._finish_grads()
        return parts

    # ---------------------------------------------------- weights, ckpt ----
    def update_weights(self, urls: list[str], version: int, feeds: list[EngineFeed] | None = None,
                       flush_cache: bool = True) -> dict[str, float]:
        with self.on_device("update_weights"):
            return self.updater.update(list(urls), int(version), feeds, flush_cache)

    def save(self, path: str) -> None:
        with self.on_device("save"):
            self._save(path)

    def load(self, path: str) -> None:
        with self.on_device("load"):
            self._load(path)

    def export_hf(self, path: str) -> None:
        with self.on_device("export_hf"):
            self._export_hf(path)

    def shutdown(self) -> None:
        """Close the weight updater, drop models, optimizer and offload buffers, destroy our process groups.
        Idempotent, and safe after a failed `init`."""
        if self.updater is not None:
            self.updater.close()
            self.updater = None
        self._release()
        self.optimizer = None
        self.offloader = DeviceOffloader(self.offloader.name)
        gc.collect()
        if use_cuda():
            torch.cuda.empty_cache()
        self._destroy_groups()
