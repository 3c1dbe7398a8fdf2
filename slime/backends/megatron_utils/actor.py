"""The Megatron-core trainer rank on the shared skeleton (`training_utils.trainer.Trainer`): megatron's GPTModel
under its DDP wrapper and optimizer, the forward through the vocab-parallel log-prob head, and the gradient
reductions. TP peers see the same samples."""

from __future__ import annotations

import json
import logging
import os

import torch

from slime.backends.megatron_utils import checkpoint as ckpt
from slime.backends.megatron_utils import parallel
from slime.backends.megatron_utils.layer_spec import describe
from slime.backends.megatron_utils.model import Built, build_gpt, forward_micro_batch, load_hf
from slime.backends.megatron_utils.optimizer import build_optimizer, build_scheduler
from slime.backends.megatron_utils.update_weight import MegatronWeightUpdater, gather_hf_weights
from slime.backends.training_utils.weight_sync import write_hf_dir
from slime.backends.training_utils.data import MicroBatch
from slime.backends.training_utils.distributed import compile_ops, physical_device_index
from slime.backends.training_utils.loss import needs_ref
from slime.backends.training_utils.offload import module_tensors, optimizer_tensors
from slime.backends.training_utils.trainer import Trainer
from slime.utils.model_shape import read_shape

logger = logging.getLogger(__name__)


class MegatronTrainer(Trainer):
    backend = "Megatron"

    def __init__(self, args, rank: int = 0, world_size: int = 1):
        super().__init__(args, rank, world_size)
        self.layout: parallel.Layout | None = None
        self.actor: Built | None = None
        self.ref: Built | None = None
        self.scheduler = None

    # ------------------------------------------------------------ set-up ----
    def _setup(self, master_addr: str, master_port: int, listen_sock) -> dict:
        args = self.args
        self.layout, self._owns_pg = parallel.init_parallel(self.rank, self.world_size, master_addr, master_port,
                                                            args.tensor_model_parallel_size, args.seed,
                                                            listen_host=args.listen_host, listen_sock=listen_sock)
        shape = read_shape(args.hf_checkpoint)
        tp = self.layout.tp_size
        self.actor = build_gpt(args, shape, tp, trainable=True, wrap_ddp=True)
        # --load naming a checkpoint train.py did not write (upstream slime's): the actor starts from its weights
        foreign = ckpt.foreign_checkpoint(args.load) if args.load else None
        self._load_initial(self.actor, foreign.model_dir if foreign is not None else args.ref_load)
        if needs_ref(args):
            self.ref = build_gpt(args, shape, tp, trainable=False, wrap_ddp=False)
            self._load_initial(self.ref, args.ref_load)
        # the optimizer copies the loaded weights into its fp32 main params: build it after loading
        self.optimizer = build_optimizer(args, self.actor)
        self.scheduler = build_scheduler(args, self.optimizer)
        self.pad_id = self._pad_id(args.hf_checkpoint)
        self.updater = MegatronWeightUpdater(args, self.actor, self.layout)
        n_params = sum(p.numel() for p in self.actor.core.parameters())
        logger.info("rank %d: Megatron GPTModel from %s (%d local params, TP %d, DP %d, ref=%s, %s, %s micro-batches); "
                    "%s", self.rank, args.ref_load or args.hf_checkpoint, n_params, tp, self.layout.dp_size,
                    self.ref is not None, "bf16" if args.bf16 else "fp32", args.micro_batch_layout,
                    describe(args, self.actor.impl))
        return {"num_params": n_params, "tp": tp, "dp": self.layout.dp_size, "device_index": physical_device_index()}

    def _load_initial(self, built: Built, ref_load: str | None) -> None:
        """`ref_load` (a torch_dist checkpoint, or a HF directory) when given, else `--hf-checkpoint`."""
        tp, tp_rank = self.layout.tp_size, self.layout.tp_rank
        if ref_load and ckpt.is_megatron_checkpoint(ref_load):
            ckpt.load_model(built, ref_load)
        else:
            load_hf(built, ref_load or self.args.hf_checkpoint, tp_rank, tp)

    @staticmethod
    def _pad_id(hf_dir: str) -> int:
        with open(os.path.join(hf_dir, "config.json")) as f:
            cfg = json.load(f)
        return next((v for v in (cfg.get("pad_token_id"), cfg.get("eos_token_id"), 0) if isinstance(v, int)), 0)

    # ------------------------------------------------------ the backend ----
    @property
    def _actor(self):
        return self.actor

    @property
    def _ref(self):
        return self.ref

    def _seq_multiple(self) -> int:
        return self.layout.tp_size if self.args.sequence_parallel else 1

    def _forward(self, built: Built, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False):
        return forward_micro_batch(built, mb, self.temperature, int(self.args.log_probs_chunk_size), with_entropy,
                                   entropy_grad, compile_ops(self.args))

    def _set_train_mode(self, built: Built, training: bool) -> None:
        built.model.train(training)

    def _zero_grads(self) -> None:
        self.actor.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _before_backward(self, last: bool) -> None:
        if self.args.overlap_grad_reduce:  # megatron's no_sync(): a bucket's reduction starts in the last backward
            for group in self.actor.model.bucket_groups + self.actor.model.expert_parallel_bucket_groups:
                group.is_last_microbatch = last

    def _finish_grads(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.actor.model])  # DP all-reduce + the TP-replicated (q/k-norm) gradients

    def _optimizer_step(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("the Megatron optimizer skipped its step (non-finite gradients)")
        self.scheduler.step(increment=1)
        return float(grad_norm)

    def _train(self, rollout_id: int, groups, policy_version: int) -> dict[str, float]:
        metrics = super()._train(rollout_id, groups, policy_version)
        if self.args.overlap_param_gather:
            # the last step's all-gather of the updated shards would wait for the next forward: every reader of
            # the weights after train() (the push to the engines, a save, an export) must see them gathered
            self.actor.model.start_param_sync(force_sync=True)
        return metrics

    def _dp(self) -> tuple[int, int]:
        return self.layout.dp_rank, self.layout.dp_size

    def _dp_groups(self) -> tuple:
        from megatron.core import parallel_state as mpu

        # the gloo twin: pickled objects stay on the CPU even where the DP group is NCCL (TP peers hold the same data)
        return mpu.get_data_parallel_group(), mpu.get_data_parallel_group_gloo(with_context_parallel=False)

    # ---------------------------------------------------- weights, ckpt ----
    def _save(self, path: str) -> None:
        ckpt.save(self, path)

    def _load(self, path: str) -> None:
        ckpt.load(self, path)

    def _export_hf(self, path: str) -> None:
        import torch.distributed as dist

        state = dict(gather_hf_weights(self.actor, self.layout))
        if self.rank == 0:
            write_hf_dir(state, path, self.args.hf_checkpoint)
        dist.barrier()

    def _state_tensors(self):
        """--offload: the models' parameters and gradient buffers, the optimizer's main weights and state."""
        for built in (self.actor, self.ref):
            if built is not None:
                yield from module_tensors(built.model)
        for opt in megatron_inner_optimizers(self.optimizer):
            yield from optimizer_tensors(opt)

    # ---------------------------------------------------------- shutdown ----
    def _release(self) -> None:
        self.actor = None
        self.ref = None
        self.scheduler = None

    def _destroy_groups(self) -> None:
        if self.layout is None:  # never set up (or already shut down): the groups may be another trainer's
            return
        parallel.destroy_parallel(self._owns_pg)
        self._owns_pg = False
        self.layout = None


def megatron_inner_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (a ChainedOptimizer holds several)."""
    chained = optimizer.__dict__.get("chained_optimizers")
    parts = chained if chained is not None else [optimizer]
    return [p.optimizer for p in parts if p.__dict__.get("optimizer") is not None]
