"""Megatron trainer test helpers: a function on N spawned gloo ranks with a deadline, and the probes compared
(full gradients, full weights, logits)."""

from __future__ import annotations

import copy
import os
import socket
import time
import traceback

import torch

from test_fsdp_helpers import make_args, make_groups

SPAWN_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, fn, world: int, out_dir: str, args: tuple) -> None:
    try:
        torch.set_num_threads(1)
        fn(rank, world, out_dir, *args)
    except BaseException:
        with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn(fn, world: int, out_dir: str, *args, timeout: float = SPAWN_TIMEOUT_S) -> None:
    """`fn(rank, world, out_dir, *args)` on `world` fresh processes; raises
    with the failing rank's traceback, or after `timeout` seconds (and kills
    the processes: a hung dist-checkpoint save must not hang the suite)."""
    import torch.multiprocessing as mp

    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.start_processes(_run_rank, args=(fn, world, out_dir, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        # the ranks' exits (waitpid), not torch's join: that waits for multiprocessing's sentinel pipes, and a rank
        # that shares CPU tensors starts torch_shm_manager, which inherits the rank's end of its pipe and lives on
        # while any process holds such memory (a fake engine of the parent's that a rank pushed weights to)
        while any(p.is_alive() for p in ctx.processes):
            failed = [r for r, p in enumerate(ctx.processes) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"rank {failed[0]} exited with code {ctx.processes[failed[0]].exitcode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} ranks did not finish within {timeout:.0f}s")
            time.sleep(0.1)
        failed = [r for r, p in enumerate(ctx.processes) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"rank {failed[0]} exited with code {ctx.processes[failed[0]].exitcode}")
    except Exception as e:
        errors = [open(os.path.join(out_dir, f)).read() for f in sorted(os.listdir(out_dir)) if f.startswith("error_")]
        raise RuntimeError(f"{fn.__name__} failed: {e}\n" + "\n".join(errors)) from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def megatron_args(model_dir: str, *argv: str, **over):
    return make_args(model_dir, "--train-backend", "megatron", *argv, **over)


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """Collective over TP: every parameter as its full TP=1 tensor (Megatron names)."""
    from slime.backends.megatron_utils.update_weight import gather_full

    return {k: v.detach().float().clone() for k, v in gather_full(trainer.actor, trainer.layout)}


def full_grads(trainer) -> dict[str, torch.Tensor]:
    """Collective over TP: the reduced gradient of every parameter, full size."""
    import torch.distributed as dist

    from slime.backends.megatron_utils import hf_weights
    from slime.backends.megatron_utils.parallel import tp_group

    params = dict(trainer.actor.core.named_parameters())
    out = {}
    for name in hf_weights.megatron_names(trainer.actor.shape):
        g = params[name].main_grad.detach().float().contiguous()
        if trainer.layout.tp_size > 1 and hf_weights.is_tp_split(name):
            parts = [torch.empty_like(g) for _ in range(trainer.layout.tp_size)]
            dist.all_gather(parts, g, group=tp_group())
            g = hf_weights.unshard(name, parts)
        out[name] = g.clone()
    return out


def step_grads(trainer, groups) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and full gradients of one optimizer step on `groups` (no update)."""
    items, rt, _ = trainer._prepare(copy.deepcopy(groups))
    parts = trainer._accumulate_grads(items, rt)
    loss = trainer._dp_sum([parts["loss"]])[0]
    return loss, full_grads(trainer)


@torch.no_grad()
def full_logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    """[B, S, vocab] logits of the actor (gathered over TP, padding cut)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    model = trainer.actor.model
    pos = torch.arange(ids.size(1)).unsqueeze(0).expand_as(ids)
    model.eval()
    logits = model(input_ids=ids, position_ids=pos, attention_mask=None)
    model.train()
    return gather_from_tensor_model_parallel_region(logits)[..., : trainer.actor.shape.vocab_size].clone()


GROUPS_SEED = 21
FIXED_IDS = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 3, 4, 12], [1, 9, 9, 4, 3, 14, 2, 0, 0, 0]])


PAD_ID = 0  # the tiny tokenizer's pad token (config.json pad_token_id)


def groups():
    """make_groups' samples, some with the pad token inside (its embedding row takes no gradient from it, as in
    transformers: model.py), so every layout's gradients check that too."""
    out = make_groups(seed=GROUPS_SEED)
    for s in [s for g in out for s in g][::2]:
        s.tokens[1] = s.tokens[-1] = PAD_ID
    return out
