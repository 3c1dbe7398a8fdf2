"""Megatron trainer checkpoints: megatron's dist-checkpoint (torch_dist: weights, reshardable optimizer state
and LR scheduler) plus per-rank RNG state and `trainer_meta.json` inside the `trainer/` part of our atomic
`iter_NNNNNNN/`; loads at another TP/DP layout. Three traps of megatron-core 0.16.1's torch-Adam path are handled
here (`_init_optimizer_state`, `_load_optimizer`, `_restore_steps`). Upstream slime's (Megatron-LM's) model
checkpoints load too: `--ref-load`, and `--load` (`foreign_checkpoint`: weights only).
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slime.utils.checkpoint import LATEST as TRACKER
from slime.utils.checkpoint import model_dir_of, model_only_checkpoint
from slime.utils.safe_load import check_dist_checkpoint, safe_torch_load

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DIST_OPTIM_SHARDING = "fully_reshardable"


def megatron_safe_globals() -> list:
    """What Megatron-LM's `common.pt` may name (its args Namespace, a few enums): megatron-core's own list."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    return list(SAFE_GLOBALS)


# -------------------------------------------------------------- finding ----
def is_megatron_checkpoint(path: str) -> bool:
    return model_dir_of(path) is not None


@dataclass
class ForeignCheckpoint:
    """A model checkpoint `--load` names that train.py did not write: the actor starts from its weights."""

    model_dir: str
    iteration: int | None  # the rollout id it was saved at (None: a converter's `release`)

    @property
    def start_rollout(self) -> int:
        return 0 if self.iteration is None else self.iteration + 1


def foreign_checkpoint(load_dir: str) -> ForeignCheckpoint | None:
    """`load_dir`'s newest checkpoint if it is a model dist-checkpoint train.py did not write (its files are
    checked first: nothing in them runs)."""
    from megatron.core import dist_checkpointing

    where = model_only_checkpoint(load_dir)
    if where is None:
        return None
    check_dist_checkpoint(where, megatron_safe_globals())
    iteration = None
    if os.path.basename(where) != "release":  # upstream's converter saves iteration 1, then names it release
        iteration = dist_checkpointing.load_common_state_dict(where).get("iteration")
    return ForeignCheckpoint(where, int(iteration) if isinstance(iteration, int) else None)


# ----------------------------------------------------------------- model ----
def _model_sharded(built) -> dict:
    return built.core.sharded_state_dict(prefix="")


def _dist_save(state: dict, path: str) -> None:
    from megatron.core import dist_checkpointing

    try:  # megatron's checkpoint writer needs psutil; without it a save never returns
        import psutil  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise RuntimeError("megatron dist-checkpointing needs psutil (pip install psutil); without it a save hangs") from e
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path)


def save_model(built, path: str) -> None:
    """Collective. The GPTModel's weights as a dist-checkpoint in `path`."""
    _dist_save({"model": _model_sharded(built)}, path)


def load_model(built, path: str) -> None:
    """Collective. Weights from any dist-checkpoint of the same model (any TP)."""
    from megatron.core import dist_checkpointing

    where = model_dir_of(path)
    if where is None:
        raise FileNotFoundError(f"{path!r} holds no megatron model checkpoint (no metadata.json)")
    # {"model": ...} as megatron-LM (and slime's converter) store it; the rest of the file is ignored
    check_dist_checkpoint(where, megatron_safe_globals())  # its .metadata is unpickled by torch: nothing else runs
    loaded = dist_checkpointing.load({"model": _model_sharded(built)}, where)
    built.core.load_state_dict(loaded["model"], strict=True)
    logger.info("loaded model weights from %s", where)


# ------------------------------------------------------------- optimizer ----
def _optimizer_sharded(trainer, model_sharded: dict, is_loading: bool) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    opt = trainer.optimizer
    inner = getattr(opt, "chained_optimizers", [opt])
    if any(isinstance(o, DistributedOptimizer) for o in inner):
        _init_optimizer_state(inner)
        return opt.sharded_state_dict(model_sharded, is_loading=is_loading,
                                      metadata={"distrib_optim_sharding_type": DIST_OPTIM_SHARDING})
    return opt.sharded_state_dict(model_sharded, is_loading=is_loading)


def _torch_adam() -> bool:
    """The traps below are those of megatron's torch-Adam fallback (no apex / TransformerEngine)."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    return not HAVE_APEX_OR_TE


def _init_optimizer_state(optimizers) -> None:
    """Trap (a): the distributed optimizer's `state_dict()` needs Adam's state, with a `step`, on every
    parameter; a fresh optimizer has none. Zero moments and step 0 are exactly a fresh Adam."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for o in optimizers:
        if not isinstance(o, DistributedOptimizer):
            continue
        if not _torch_adam():
            if not o.optimizer.state:
                o.init_state_fn(o.optimizer, o.config)
            continue
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                st = o.optimizer.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                st.setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _load_optimizer(opt, inner: list, state: dict) -> None:
    """Trap (b): loading the fully-reshardable parameter state copies every entry from the file, which has no
    `step` (`KeyError: 'step'`): param groups first, drop the steps, then the parameter state (under no_grad:
    the copies go into leaf tensors that require grad); `_restore_steps` puts the steps back."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not any(isinstance(o, DistributedOptimizer) for o in inner) or not _torch_adam():
        with torch.no_grad():
            opt.load_state_dict(state)
        return
    if len(inner) != 1:
        raise NotImplementedError(f"checkpoint load: {len(inner)} chained distributed optimizers (MoE?)")
    o = inner[0]
    param_state = state.pop("param_state")
    kind = state.pop("param_state_sharding_type")
    if kind != DIST_OPTIM_SHARDING:
        raise ValueError(f"optimizer checkpoint in {kind!r} format; expected {DIST_OPTIM_SHARDING!r}")
    with torch.no_grad():
        o.load_state_dict(state)
        for st in o.optimizer.state.values():
            st.pop("step", None)
        o.load_parameter_state_from_fully_reshardable(param_state)


def _restore_steps(optimizers, step: int) -> None:
    """Trap (c): after a load, every parameter needs its own `step` tensor (else Adam's bias correction is wrong)."""
    if not _torch_adam():
        return
    for o in optimizers:
        for st in o.optimizer.state.values():
            if st:
                st["step"] = torch.tensor(float(step), dtype=torch.float32)


def save_state(trainer, path: str) -> None:
    """Collective: weights + optimizer + scheduler as one dist-checkpoint."""
    model_sharded = _model_sharded(trainer.actor)
    state = {"model": model_sharded,
             "optimizer": _optimizer_sharded(trainer, model_sharded, is_loading=False),
             "scheduler": trainer.scheduler.state_dict(),
             "adam_step": trainer.scheduler.num_steps}
    _dist_save(state, path)


def load_state(trainer, path: str) -> None:
    from megatron.core import dist_checkpointing

    model_sharded = _model_sharded(trainer.actor)
    opt = trainer.optimizer
    inner = getattr(opt, "chained_optimizers", [opt])
    sharded = {"model": model_sharded, "optimizer": _optimizer_sharded(trainer, model_sharded, is_loading=True)}
    loaded = dist_checkpointing.load(sharded, path)
    trainer.actor.core.load_state_dict(loaded["model"], strict=True)
    _load_optimizer(opt, inner, loaded["optimizer"])
    _restore_steps(inner, int(loaded["adam_step"]))
    trainer.scheduler.load_state_dict(loaded["scheduler"])


# ------------------------------------------------------------------- RNG ----
def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------- trainer ----
def save(trainer, path: str) -> None:
    """Collective: model, optimizer + scheduler, every rank's RNG, meta."""
    lay = trainer.layout
    rank = dist.get_rank()
    save_state(trainer, os.path.join(path, "torch_dist"))
    torch.save(rng_state(), os.path.join(path, f"rng_rank{rank}.pt"))
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "backend": "megatron", "world_size": lay.world_size,
                "tp": lay.tp_size, "dp": lay.dp_size, "hf_checkpoint": trainer.args.hf_checkpoint,
                "distributed_optimizer": bool(trainer.args.use_distributed_optimizer)}
        with open(os.path.join(path, "trainer_meta.json"), "w") as f:
            json.dump(meta, f)
    dist.barrier()


def load(trainer, path: str) -> None:
    meta_file = os.path.join(path, "trainer_meta.json")
    if not os.path.isfile(meta_file):
        raise FileNotFoundError(f"trainer checkpoint {path!r} has no trainer_meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("backend") != "megatron":
        raise ValueError(f"{path}: a checkpoint of the {meta.get('backend', 'fsdp')} backend; "
                         f"it cannot be resumed with --train-backend megatron")
    if bool(meta["distributed_optimizer"]) != bool(trainer.args.use_distributed_optimizer):
        flag = "--use-distributed-optimizer" if meta["distributed_optimizer"] else "--no-use-distributed-optimizer"
        raise ValueError(f"{path}: saved with {flag}; resume with {flag} too (the two optimizers store their state "
                         "differently; the distributed one is the default with --train-backend megatron)")
    check_dist_checkpoint(os.path.join(path, "torch_dist"))  # its .metadata is unpickled by torch: nothing else runs
    load_state(trainer, os.path.join(path, "torch_dist"))
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    same_layout = (meta["tp"], meta["dp"]) == (trainer.layout.tp_size, trainer.layout.dp_size)
    if same_layout and os.path.exists(rng_file):
        set_rng_state(safe_torch_load(rng_file))
    else:
        logger.warning("%s: saved at TP %d x DP %d, loading at TP %d x DP %d: RNG streams stay as seeded", path,
                       meta["tp"], meta["dp"], trainer.layout.tp_size, trainer.layout.dp_size)
    dist.barrier()
