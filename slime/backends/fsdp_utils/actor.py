"""The FSDP2 trainer rank on the shared skeleton (`training_utils.trainer.Trainer`): a transformers causal LM
sharded with FSDP2 (bf16 compute over fp32 master weights with --bf16), AdamW, the chunked log-prob head."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from slime.backends.fsdp_utils import checkpoint as ckpt
from slime.backends.fsdp_utils.model import build_model, describe, forward_micro_batch, init_distributed
from slime.backends.fsdp_utils.update_weight import FSDPWeightUpdater
from slime.backends.training_utils.data import MicroBatch
from slime.backends.training_utils.distributed import compile_ops, physical_device_index
from slime.backends.training_utils.loss import needs_ref
from slime.backends.training_utils.offload import module_tensors, optimizer_tensors
from slime.backends.training_utils.trainer import Trainer

logger = logging.getLogger(__name__)


class FSDPTrainer(Trainer):
    backend = "FSDP"

    def __init__(self, args, rank: int = 0, world_size: int = 1):
        super().__init__(args, rank, world_size)
        self.model = None
        self.ref_model = None

    # ------------------------------------------------------------ set-up ----
    def _setup(self, master_addr: str, master_port: int, listen_sock) -> dict:
        args = self.args
        self._owns_pg = init_distributed(self.rank, self.world_size, master_addr, master_port,
                                         listen_host=args.listen_host, listen_sock=listen_sock)
        torch.manual_seed(int(args.seed) + self.rank)
        hf = args.hf_checkpoint
        if not hf:
            raise ValueError("--hf-checkpoint is required for the FSDP trainer")
        self.model = build_model(hf, trainable=True, args=args)
        self.model.train()
        if needs_ref(args):
            self.ref_model = build_model(args.ref_load or hf, trainable=False, args=args)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=float(args.lr),
            betas=(float(args.adam_beta1), float(args.adam_beta2)),
            eps=float(args.adam_eps),
            weight_decay=float(args.weight_decay),
        )
        cfg = self.model.config
        self.pad_id = next((v for v in (cfg.pad_token_id, cfg.eos_token_id, 0) if isinstance(v, int)), 0)
        self.updater = FSDPWeightUpdater(args, self.model, self.rank)
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info("rank %d: loaded %s (%d params, ref=%s, %s compute, fp32 master weights, %s micro-batches); %s",
                    self.rank, hf, n_params, self.ref_model is not None, "bf16" if args.bf16 else "fp32",
                    args.micro_batch_layout, describe(args))
        return {"num_params": n_params, "device_index": physical_device_index()}

    # ------------------------------------------------------ the backend ----
    @property
    def _actor(self):
        return self.model

    @property
    def _ref(self):
        return self.ref_model

    def _forward(self, model, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False):
        return forward_micro_batch(model, mb, self.temperature, int(self.args.log_probs_chunk_size), with_entropy,
                                   entropy_grad, compile_ops(self.args))

    def _set_train_mode(self, model, training: bool) -> None:
        model.train(training)

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _before_backward(self, last: bool) -> None:
        # One rank: nothing to reduce, yet FSDP2 would copy every gradient and parameter in and out of its shards
        # around every micro-batch; so they stay unsharded until the step's last backward
        if self.world_size == 1:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def _optimizer_step(self) -> float:
        clip = float(self.args.clip_grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _dp(self) -> tuple[int, int]:
        return self.rank, self.world_size

    # ---------------------------------------------------- weights, ckpt ----
    def _save(self, path: str) -> None:
        ckpt.save(self.model, self.optimizer, path, self.args.hf_checkpoint)

    def _load(self, path: str) -> None:
        ckpt.load(self.model, self.optimizer, path)

    def _export_hf(self, path: str) -> None:
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

    # ---------------------------------------------------------- shutdown ----
    def _release(self) -> None:
        self.model = None
        self.ref_model = None

    def _destroy_groups(self) -> None:
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_pg = False
