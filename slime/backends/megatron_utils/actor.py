"""The Megatron-core trainer: one instance per trainer rank (a Ray actor in a
run, a plain object in tests), the same interface as the FSDP trainer.
Every public method that touches the model is a collective: call it on
every rank (RayTrainGroup does).

Ranks form TP groups (`--tensor-model-parallel-size`) and data-parallel
replicas; TP peers see the same samples. Per `train` call: drop FAILED
samples, compute old-policy (and reference) log-probs for the rollout
(split over DP replicas, then gathered), compute advantages / TIS weights
with the shared code (`slime.backends.training_utils.loss`), then run
len(samples) / --global-batch-size optimizer steps, each accumulating
gradients over this replica's micro-batches (fixed size or by token budget).
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict

import torch

from slime.backends.megatron_utils import checkpoint as ckpt
from slime.backends.megatron_utils import parallel
from slime.backends.megatron_utils.model import Built, build_gpt, forward_items, load_hf
from slime.backends.megatron_utils.optimizer import build_optimizer, build_scheduler
from slime.backends.megatron_utils.update_weight import MegatronWeightUpdater, gather_hf_weights, write_hf_dir
from slime.backends.training_utils.data import TrainItem, flatten_groups, micro_batches, shard, split_steps
from slime.backends.training_utils.distributed import open_master_port, physical_device_index
from slime.backends.training_utils.offload import DeviceOffloader, Offloadable, module_tensors, optimizer_tensors
from slime.backends.training_utils.weight_feed import EngineFeed
from slime.backends.training_utils.loss import RolloutTensors, compute_rollout_tensors, micro_batch_loss, needs_ref
from slime.utils.model_shape import read_shape
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


class MegatronTrainer(Offloadable):
    def __init__(self, args, rank: int = 0, world_size: int = 1):
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.layout: parallel.Layout | None = None
        self.actor: Built | None = None
        self.ref: Built | None = None
        self.optimizer = None
        self.scheduler = None
        self.updater: MegatronWeightUpdater | None = None
        self._owns_pg = False
        self.offloader = DeviceOffloader(f"Megatron trainer rank {rank}")
        self._master_sock = None

    # ------------------------------------------------------------ set-up ----
    def open_master_port(self) -> tuple[str, int]:
        """Rank 0: open the process-group store's listening socket on --listen-host now (kept for `init`);
        returns (address the other ranks connect to, port)."""
        self._master_sock, address, port = open_master_port(self.args.listen_host)
        return address, port

    def init(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict:
        args = self.args
        torch.set_num_threads(args.train_num_threads)
        if master_port is None and self.world_size != 1:
            raise ValueError("MegatronTrainer.init: master_port is required when world_size > 1")
        sock, self._master_sock = self._master_sock, None
        self.layout, self._owns_pg = parallel.init_parallel(self.rank, self.world_size, master_addr, master_port or 0,
                                                            args.tensor_model_parallel_size, args.seed,
                                                            listen_host=args.listen_host, listen_sock=sock)
        shape = read_shape(args.hf_checkpoint)
        tp = self.layout.tp_size
        self.actor = build_gpt(args, shape, tp, trainable=True, wrap_ddp=True)
        self._load_initial(self.actor, args.ref_load)
        if needs_ref(args):
            self.ref = build_gpt(args, shape, tp, trainable=False, wrap_ddp=False)
            self._load_initial(self.ref, args.ref_load)
        # the optimizer copies the loaded weights into its fp32 main params: build it after loading
        self.optimizer = build_optimizer(args, self.actor)
        self.scheduler = build_scheduler(args, self.optimizer)
        self.pad_id = self._pad_id(args.hf_checkpoint)
        self.updater = MegatronWeightUpdater(args, self.actor, self.layout)
        n_params = sum(p.numel() for p in self.actor.core.parameters())
        logger.info("rank %d: Megatron GPTModel from %s (%d local params, TP %d, DP %d, ref=%s)", self.rank,
                    args.ref_load or args.hf_checkpoint, n_params, tp, self.layout.dp_size, self.ref is not None)
        return {"num_params": n_params, "tp": tp, "dp": self.layout.dp_size, "device_index": physical_device_index()}

    def _load_initial(self, built: Built, ref_load: str | None) -> None:
        """`--ref-load` (a torch_dist checkpoint, or a HF directory) when
        given, else `--hf-checkpoint`."""
        tp, tp_rank = self.layout.tp_size, self.layout.tp_rank
        if ref_load and ckpt.is_megatron_checkpoint(ref_load):
            ckpt.load_model(built, ref_load)
        else:
            load_hf(built, ref_load or self.args.hf_checkpoint, tp_rank, tp)

    @staticmethod
    def _pad_id(hf_dir: str) -> int:
        import json

        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
        return next((v for v in (cfg.get("pad_token_id"), cfg.get("eos_token_id"), 0) if isinstance(v, int)), 0)

    # ----------------------------------------------------------- helpers ----
    @property
    def temperature(self) -> float:
        t = self.args.rollout_temperature
        return t if t > 0 else 1.0  # greedy rollouts: log-probs of the raw logits

    def _micro_batches(self, items: list[TrainItem]) -> list[list[TrainItem]]:
        max_tokens = self.args.max_tokens_per_gpu if self.args.use_dynamic_batch_size else None
        return micro_batches(items, self.args.micro_batch_size, max_tokens)

    def _forward(self, built: Built, mb: list[TrainItem], with_entropy: bool = False, entropy_grad: bool = False):
        seq_multiple = self.layout.tp_size if self.args.sequence_parallel else 1
        return forward_items(built.model, mb, self.pad_id, self.temperature, built.shape.vocab_size, seq_multiple,
                             with_entropy, entropy_grad)

    @torch.no_grad()
    def _log_probs(self, built: Built, items: list[TrainItem]) -> list[torch.Tensor]:
        """Response log-probs of every item (every rank gets all of them)."""
        lay = self.layout
        local = [items[i] for i in shard(range(len(items)), lay.dp_rank, lay.dp_size)]
        built.model.eval()
        try:
            local_out = []
            for mb in self._micro_batches(local):
                lps, _, _ = self._forward(built, mb)
                local_out += [(it.pos, lp.detach().float().cpu()) for it, lp in zip(mb, lps)]
        finally:
            if built is self.actor:
                built.model.train()
        gathered = parallel.dp_all_gather_object(local_out) if lay.dp_size > 1 else [local_out]
        out: list[torch.Tensor | None] = [None] * len(items)
        for part in gathered:
            for pos, lp in part:
                out[pos] = lp
        return out  # type: ignore[return-value]

    def _metric_keys(self) -> list[str]:
        if self.args.loss_type == "sft_loss":
            return ["sft_loss", "loss"]
        keys = ["pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "loss"]
        return keys + (["kl_loss"] if self.args.use_kl_loss else [])

    # ------------------------------------------------------------- train ----
    def train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int = 0) -> dict[str, float]:
        with self.on_device("train"):
            return self._train(rollout_id, groups, policy_version)

    def _train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        items, rt, metrics = self._prepare(groups)
        if not items:
            logger.warning("rollout %d: no trainable samples (%d failed); skipping the update", rollout_id,
                           int(metrics["num_failed_excluded"]))
            return metrics
        metrics["old_logprob_time_s"] = time.perf_counter() - t0
        steps = split_steps(len(items), self.args.global_batch_size)
        sums: dict[str, float] = defaultdict(float)
        for positions in steps:
            for k, v in self._train_step([items[p] for p in positions], rt).items():
                sums[k] += v
        metrics.update({k: v / len(steps) for k, v in sums.items()})
        metrics["num_optimizer_steps"] = float(len(steps))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["train_time_s"] = time.perf_counter() - t0
        logger.info("rollout %d (policy v%d): %d samples, %d steps, loss %.4g, grad_norm %.4g", rollout_id,
                    policy_version, len(items), len(steps), metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0))
        return metrics

    def _prepare(self, groups: list[list[Sample]]) -> tuple[list[TrainItem], RolloutTensors | None, dict]:
        """Samples → items, old / reference log-probs, advantages and TIS weights."""
        item_groups, n_failed = flatten_groups(groups, self.args.reward_key)
        items = [it for g in item_groups for it in g]
        metrics: dict[str, float] = {"num_samples": float(len(items)), "num_failed_excluded": float(n_failed)}
        if not items:
            return items, None, metrics
        old = self._log_probs(self.actor, items)
        ref = self._log_probs(self.ref, items) if self.ref is not None else None
        rt = compute_rollout_tensors(self.args, item_groups, old, ref)
        metrics.update(rt.metrics)
        return items, rt, metrics

    def _train_step(self, step_items: list[TrainItem], rt: RolloutTensors) -> dict[str, float]:
        parts = self._accumulate_grads(step_items, rt)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("the Megatron optimizer skipped its step (non-finite gradients)")
        self.scheduler.step(increment=1)
        keys = self._metric_keys()
        out = dict(zip(keys, parallel.dp_sum([parts.get(k, 0.0) for k in keys])))
        out["grad_norm"] = float(grad_norm)
        return out

    def _accumulate_grads(self, step_items: list[TrainItem], rt: RolloutTensors) -> dict[str, float]:
        """Forward / backward over this replica's micro-batches of one
        optimizer step, then the gradient reductions; returns this replica's
        metric parts."""
        from megatron.core.distributed import finalize_model_grads

        lay, args = self.layout, self.args
        num_tokens = float(sum(float(it.loss_mask.sum()) for it in step_items))
        num_samples = float(len(step_items))
        model = self.actor.model
        model.zero_grad_buffer()
        self.optimizer.zero_grad()
        parts: dict[str, float] = defaultdict(float)
        for mb in self._micro_batches(shard(step_items, lay.dp_rank, lay.dp_size)):
            lps, ents, _ = self._forward(self.actor, mb, with_entropy=True, entropy_grad=args.entropy_coef != 0.0)
            loss, m = micro_batch_loss(args, lps, ents, [it.pos for it in mb], [it.loss_mask for it in mb], rt,
                                       num_tokens, num_samples)
            m["loss"] = float(loss.detach())
            for key, v in m.items():
                parts[key] += v
            # Megatron's DDP averages gradients over replicas; the loss is already a global mean
            (loss * lay.dp_size).backward()
        finalize_model_grads([model])  # DP all-reduce + the TP-replicated (q/k-norm) gradients
        return parts

    # ---------------------------------------------------- weights, ckpt ----
    def update_weights(self, urls: list[str], version: int, feeds: list[EngineFeed] | None = None) -> dict[str, float]:
        with self.on_device("update_weights"):
            return self.updater.update(list(urls), int(version), feeds)

    def save(self, path: str) -> None:
        with self.on_device("save"):
            ckpt.save(self, path)

    def load(self, path: str) -> None:
        with self.on_device("load"):
            ckpt.load(self, path)

    def export_hf(self, path: str) -> None:
        import torch.distributed as dist

        with self.on_device("export_hf"):
            state = dict(gather_hf_weights(self.actor, self.layout))
            if self.rank == 0:
                write_hf_dir(state, path, self.args.hf_checkpoint)
        dist.barrier()

    def _state_tensors(self):
        """--offload: parameters (and Megatron's contiguous parameter / gradient buffers behind them), the
        optimizer's fp32 main weights and Adam state, for the policy and the reference model."""
        for built in (self.actor, self.ref):
            if built is not None:
                yield from module_tensors(built.model)
        for opt in megatron_inner_optimizers(self.optimizer):
            yield from optimizer_tensors(opt)

    def ready(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if self.layout is None:  # never initialised, or already shut down
            return
        if self.updater is not None:
            self.updater.close()
            self.updater = None
        parallel.destroy_parallel(self._owns_pg)
        self._owns_pg = False
        self.layout = None


def megatron_inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (a ChainedOptimizer holds several)."""
    chained = optimizer.__dict__.get("chained_optimizers")
    parts = chained if chained is not None else [optimizer]
    return [p.optimizer for p in parts if p.__dict__.get("optimizer") is not None]
