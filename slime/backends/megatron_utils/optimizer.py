"""Megatron's optimizer (Adam; fp32 main weights under --bf16; optionally sharded over DP) and LR schedule."""

from __future__ import annotations

import torch

from slime.backends.megatron_utils.model import Built


def build_optimizer(args, built: Built):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        # clip_grad 0 = off: an infinite bound keeps the grad-norm metric without clipping
        clip_grad=args.clip_grad if args.clip_grad > 0 else float("inf"),
        bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )
    return get_megatron_optimizer(cfg, [built.model])


def build_scheduler(args, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    warmup = args.lr_warmup_iters
    decay = args.lr_decay_iters if args.lr_decay_style != "constant" else warmup + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
