"""The FSDP2 trainer: one instance per data-parallel rank (a Ray actor in a
run, a plain object in tests). Every public method that touches the model is
a collective: call it on every rank (RayTrainGroup does).

Per `train` call: drop FAILED samples, compute old-policy (and reference)
log-probs for the whole rollout with the current weights (sharded across
ranks, then gathered), compute advantages / TIS weights, then run
len(samples) / --global-batch-size optimizer steps, each accumulating
gradients over micro-batches of this rank's share.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils import checkpoint as ckpt
from slime.backends.training_utils.data import (
    TrainItem,
    dummy_item,
    flatten_groups,
    micro_batches,
    shard,
    split_steps,
)
from slime.backends.training_utils.loss import (
    RolloutTensors,
    compute_rollout_tensors,
    micro_batch_loss,
    needs_ref,
)
from slime.backends.fsdp_utils.model import build_model, forward_items, init_distributed
from slime.backends.fsdp_utils.update_weight import WeightUpdater
from slime.backends.training_utils.distributed import open_master_port, physical_device_index
from slime.backends.training_utils.offload import DeviceOffloader, Offloadable, module_tensors, optimizer_tensors
from slime.backends.training_utils.weight_feed import EngineFeed
from slime.utils.types import Sample

logger = logging.getLogger(__name__)


class FSDPTrainer(Offloadable):
    def __init__(self, args, rank: int = 0, world_size: int = 1):
        self.args = args
        self.rank = rank
        self.world_size = world_size
        self.model = None
        self.ref_model = None
        self.optimizer = None
        self.updater = None
        self._owns_pg = False
        self.offloader = DeviceOffloader(f"FSDP trainer rank {rank}")
        self._master_sock = None

    # ------------------------------------------------------------ set-up ----
    def open_master_port(self) -> tuple[str, int]:
        """Rank 0: open the process-group store's listening socket on --listen-host now (so no other
        process can take the port before `init`); returns (address the other ranks connect to, port)."""
        self._master_sock, address, port = open_master_port(self.args.listen_host)
        return address, port

    def init(self, master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict:
        args = self.args
        torch.set_num_threads(int(args.train_num_threads))
        if master_port is None and self.world_size != 1:
            raise ValueError("FSDPTrainer.init: master_port is required when world_size > 1")
        sock, self._master_sock = self._master_sock, None
        self._owns_pg = init_distributed(self.rank, self.world_size, master_addr, master_port or 0,
                                         listen_host=args.listen_host, listen_sock=sock)
        torch.manual_seed(int(args.seed) + self.rank)
        hf = args.hf_checkpoint
        if not hf:
            raise ValueError("--hf-checkpoint is required for the FSDP trainer")
        attn = args.attn_implementation
        self.model = build_model(hf, trainable=True, attn_implementation=attn)
        self.model.train()
        if needs_ref(args):
            self.ref_model = build_model(args.ref_load or hf, trainable=False, attn_implementation=attn)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(args.lr),
            betas=(float(args.adam_beta1), float(args.adam_beta2)),
            eps=float(args.adam_eps),
            weight_decay=float(args.weight_decay),
        )
        cfg = self.model.config
        self.pad_id = next((v for v in (cfg.pad_token_id, cfg.eos_token_id, 0) if isinstance(v, int)), 0)
        self.updater = WeightUpdater(args, self.model, self.rank)
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("rank %d: loaded %s (%d params, ref=%s)", self.rank, hf, n_params, self.ref_model is not None)
        return {"num_params": n_params, "device_index": physical_device_index()}

    # ----------------------------------------------------------- helpers ----
    @property
    def temperature(self) -> float:
        t = float(self.args.rollout_temperature)
        return t if t > 0 else 1.0  # greedy rollouts: log-probs of the raw logits

    def _micro_batches(self, items: list[TrainItem]) -> list[list[TrainItem]]:
        max_tokens = self.args.max_tokens_per_gpu if self.args.use_dynamic_batch_size else None
        if self.args.use_dynamic_batch_size and not max_tokens:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
        return micro_batches(items, int(self.args.micro_batch_size), max_tokens)

    def _max_over_ranks(self, n: int) -> int:
        if self.world_size == 1:
            return n
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @torch.no_grad()
    def _log_probs(self, model, items: list[TrainItem]) -> list[torch.Tensor]:
        """Response log-probs of every item (all ranks get all of them)."""
        local = [items[i] for i in shard(range(len(items)), self.rank, self.world_size)]
        mbs = self._micro_batches(local)
        local_out: list[tuple[int, torch.Tensor]] = []
        for k in range(self._max_over_ranks(len(mbs))):
            mb = mbs[k] if k < len(mbs) else [dummy_item(self.pad_id)]
            lps, _, _ = forward_items(model, mb, self.pad_id, self.temperature)
            if k < len(mbs):
                local_out += [(it.pos, lp.detach().float().cpu()) for it, lp in zip(mb, lps)]
        if self.world_size > 1:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, local_out)
            local_out = [x for part in gathered for x in part]
        out: list[torch.Tensor | None] = [None] * len(items)
        for pos, lp in local_out:
            out[pos] = lp
        return out  # type: ignore[return-value]

    def _metric_keys(self) -> list[str]:
        if self.args.loss_type == "sft_loss":
            return ["sft_loss", "loss"]
        keys = ["pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "loss"]
        keys += ["pg_dual_clipfrac"] if self.args.eps_clip_c is not None else []
        return keys + (["kl_loss"] if self.args.use_kl_loss else [])

    # ------------------------------------------------------------- train ----
    def train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int = 0) -> dict[str, float]:
        with self.on_device("train"):
            return self._train(rollout_id, groups, policy_version)

    def _train(self, rollout_id: int, groups: list[list[Sample]], policy_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        item_groups, n_failed = flatten_groups(groups, self.args.reward_key)
        items = [it for g in item_groups for it in g]
        metrics: dict[str, float] = {"num_samples": float(len(items)), "num_failed_excluded": float(n_failed)}
        if not items:
            logger.warning("rollout %d: no trainable samples (%d failed); skipping the update", rollout_id, n_failed)
            return metrics
        old = self._log_probs(self.model, items)
        ref = self._log_probs(self.ref_model, items) if self.ref_model is not None else None
        rt = compute_rollout_tensors(self.args, item_groups, old, ref)
        metrics.update(rt.metrics)
        metrics["old_logprob_time_s"] = time.perf_counter() - t0

        steps = split_steps(len(items), int(self.args.global_batch_size))
        sums: dict[str, float] = defaultdict(float)
        for positions in steps:
            step = self._train_step([items[p] for p in positions], rt)
            for k, v in step.items():
                sums[k] += v
        metrics.update({k: v / len(steps) for k, v in sums.items()})
        metrics["num_optimizer_steps"] = float(len(steps))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["train_time_s"] = time.perf_counter() - t0
        logger.info("rollout %d (policy v%d): %d samples, %d steps, loss %.4g, grad_norm %.4g", rollout_id,
                    policy_version, len(items), len(steps), metrics.get("loss", 0.0), metrics.get("grad_norm", 0.0))
        return metrics

    def _train_step(self, step_items: list[TrainItem], rt: RolloutTensors) -> dict[str, float]:
        ws = self.world_size
        num_tokens = float(sum(float(it.loss_mask.sum()) for it in step_items))
        num_samples = float(len(step_items))
        local = shard(step_items, self.rank, ws)
        mbs = self._micro_batches(local)
        parts: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        for k in range(self._max_over_ranks(len(mbs))):
            if k < len(mbs):
                mb = mbs[k]
                lps, ents, _ = forward_items(self.model, mb, self.pad_id, self.temperature, with_entropy=True,
                                             entropy_grad=float(self.args.entropy_coef) != 0.0)
                loss, m = micro_batch_loss(self.args, lps, ents, [it.pos for it in mb], [it.loss_mask for it in mb],
                                           rt, num_tokens, num_samples)
                m["loss"] = float(loss.detach())
                for key, v in m.items():
                    parts[key] += v
            else:  # this rank ran out of data: a no-op pass keeps the FSDP collectives in step
                _, _, logits = forward_items(self.model, [dummy_item(self.pad_id)], self.pad_id, self.temperature)
                loss = logits.sum() * 0.0
            # FSDP averages gradients over ranks; the loss is already a global mean
            (loss * ws).backward()
        clip = float(self.args.clip_grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        keys = self._metric_keys()
        vec = torch.tensor([parts.get(k, 0.0) for k in keys], dtype=torch.float64)
        if ws > 1:
            dist.all_reduce(vec)
        out = dict(zip(keys, vec.tolist()))
        out["grad_norm"] = float(grad_norm)
        return out

    # ---------------------------------------------------- weights, ckpt ----
    def update_weights(self, urls: list[str], version: int, feeds: list[EngineFeed] | None = None) -> dict[str, float]:
        with self.on_device("update_weights"):
            return self.updater.update(list(urls), int(version), feeds)

    def save(self, path: str) -> None:
        with self.on_device("save"):
            ckpt.save(self.model, self.optimizer, path, self.args.hf_checkpoint)

    def load(self, path: str) -> None:
        with self.on_device("load"):
            ckpt.load(self.model, self.optimizer, path)

    def export_hf(self, path: str) -> None:
        with self.on_device("export_hf"):
            ckpt.export_hf(self.model, path, self.args.hf_checkpoint)

    # ----------------------------------------------------------- offload ----
    def _state_tensors(self):
        """Parameters, gradients and optimizer state (policy and reference model)."""
        from torch.distributed.fsdp import FSDPModule

        for model in (self.model, self.ref_model):
            if model is None:
                continue
            for m in model.modules():  # only the sharded parameters stay registered
                if isinstance(m, FSDPModule):
                    m.reshard()
            yield from module_tensors(model)
        yield from optimizer_tensors(self.optimizer)

    def ready(self) -> int:
        return self.rank

    def shutdown(self) -> None:
        if self.updater is not None:
            self.updater.close()
            self.updater = None
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_pg = False
