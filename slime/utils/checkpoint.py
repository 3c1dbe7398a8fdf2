"""Checkpoint directories, written atomically (assembled in a tmp dir, renamed into place, then the pointer).

`resolve_checkpoint` checks a `--load` checkpoint's files before anything loads them; `check_data_contract` refuses
a resume whose flags would change what the saved data position and parked groups mean."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from typing import Any, Callable

import numpy as np
import torch

from slime.utils.safe_load import (
    CheckpointFileError,
    check_dist_checkpoint,
    check_safetensors,
    check_torch_file,
    read_json_file,
)

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"
_TMP = re.compile(r"^(iter_\d+|" + re.escape(LATEST) + r")\.(tmp|old)-(\d+)$")
# flags that fix what a saved data position / parked group means: a resume must not change them
CONTRACT_FLAGS = ("n_samples_per_prompt", "rollout_batch_size")


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the message names the path, the part and the cause."""


class CheckpointLoadError(ValueError):
    """The checkpoint to resume from is unusable; the message names the file and offers an intact one."""


def iter_dir_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_bytes(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _mb(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 1024**2:.0f} MB"


def checkpoint_size_estimate(hf_checkpoint: str | None) -> int:
    """Bytes one checkpoint needs: fp32 weights + Adam's two moments (3 x 4 bytes a parameter), +10%."""
    if not hf_checkpoint or not os.path.isdir(hf_checkpoint):
        return 0
    numel = 0
    for name in os.listdir(hf_checkpoint):
        if name.endswith(".safetensors"):
            try:
                header = check_safetensors(os.path.join(hf_checkpoint, name))
            except CheckpointFileError:
                continue
            for key, info in header.items():
                if key != "__metadata__":
                    n = 1
                    for d in info["shape"]:
                        n *= int(d)
                    numel += n
    return int(numel * 12 * 1.1)


def prepare_save_dir(save_dir: str, need_bytes: int = 0) -> None:
    """At start: `save_dir` writable with `need_bytes` free (else fail now); dead processes' tmp dirs removed."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointSaveError(f"--save {save_dir}: not writable ({e.strerror or e}: {e.filename or save_dir})") from e
    free = _free_bytes(save_dir)
    if need_bytes and free is not None and free < need_bytes:
        raise CheckpointSaveError(f"--save {save_dir}: {_mb(free)} free, but one checkpoint needs about "
                                  f"{_mb(need_bytes)} (fp32 weights + Adam state); free space or choose another --save")
    for name in sorted(os.listdir(save_dir)):
        m = _TMP.match(name)
        if m is None or (_pid_alive(int(m.group(3))) and int(m.group(3)) != os.getpid()):
            continue
        path = os.path.join(save_dir, name)
        logger.warning("removing %s, left by an interrupted save (pid %s is gone)", path, m.group(3))
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                pass


def _short_cause(e: BaseException) -> str:
    """The last line of an error (a Ray error wraps the remote traceback), and what a short write means."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"
    codes = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
    if "unexpected pos" in str(e) or "file write failed" in str(e) or getattr(e, "errno", None) in codes \
            or any(os.strerror(c) in str(e) for c in codes):
        cause += " (a short write: the disk is full or a file-size / quota limit was hit)"
    return cause


def save_checkpoint(save_dir: str, rollout_id: int, writers: dict[str, Callable[[str], None]],
                    driver_state: dict[str, Any]) -> str:
    """Write each part into a tmp dir, then publish it atomically; `CheckpointSaveError` names what failed."""
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, iter_dir_name(rollout_id))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    part = "the checkpoint directory"
    try:
        os.makedirs(tmp)
        for name, write in writers.items():
            part = f"{name}/"
            sub = os.path.join(tmp, name)
            os.makedirs(sub, exist_ok=True)
            write(sub)
        part = "driver_state.json"
        _write_atomic(os.path.join(tmp, "driver_state.json"), json.dumps(driver_state))
        part = "the checkpoint directory"
        old = f"{final}.old-{os.getpid()}"
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        part = LATEST
        _write_atomic(os.path.join(save_dir, LATEST), str(rollout_id))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        free = _free_bytes(save_dir)
        raise CheckpointSaveError(
            f"saving checkpoint {final} failed writing {part}: {_short_cause(e)}; {_mb(free)} free on {save_dir}"
            + (" (disk full?)" if free is not None and free < 64 * 1024**2 else "")
            + "; the previous checkpoint is untouched") from e
    logger.info("saved checkpoint %s", final)
    return final


def model_dir_of(path: str) -> str | None:
    """The dist-checkpoint directory of a Megatron model inside `path`: a torch_dist dir itself, a trainer dir, a
    train.py iter dir, or a tracker file's checkpoint (`iter_N/` or upstream's `release/`). None when there is none."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    for sub in ("torch_dist", os.path.join("trainer", "torch_dist")):
        if os.path.isfile(os.path.join(path, sub, "metadata.json")):
            return os.path.join(path, sub)
    tracker = os.path.join(path, LATEST)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        name = "release" if text == "release" else iter_dir_name(int(text)) if text.isdigit() else None
        if name is not None and os.path.isdir(os.path.join(path, name)):
            return model_dir_of(os.path.join(path, name))
    return None


def model_only_checkpoint(load_dir: str) -> str | None:
    """The checkpoint `load_dir`'s tracker names when it is a model dist-checkpoint train.py did not write (no
    `driver_state.json`: upstream slime's converter or training output, or our converter's), else None."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    name = "release" if text == "release" else iter_dir_name(int(text)) if text.isdigit() else None
    where = os.path.join(load_dir, name) if name else None
    if where is None or os.path.isfile(os.path.join(where, "driver_state.json")):
        return None
    return where if os.path.isfile(os.path.join(where, "metadata.json")) else None


def latest_checkpoint(load_dir: str) -> str | None:
    """The newest complete checkpoint under `load_dir`, or None if there is none yet."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    model_only = model_only_checkpoint(load_dir)
    if model_only is not None:
        raise FileNotFoundError(
            f"--load: {model_only} is a Megatron torch_dist model checkpoint (upstream slime's, or a converter's), not "
            "a train.py checkpoint: --train-backend megatron resumes its weights from it (or reads it as --ref-load); "
            "for this trainer convert "
            f"it first: python tools/convert_torch_dist_to_hf.py --input-dir {model_only} --output-dir HF_OUT "
            "--origin-hf-dir <your --hf-checkpoint>, then train from HF_OUT (--hf-checkpoint HF_OUT, no --load)")
    with open(pointer) as f:
        text = f.read().strip()
    try:
        rollout_id = int(text)
    except ValueError as e:
        raise ValueError(f"--load: {pointer} holds {text!r}, not a rollout id") from e
    path = os.path.join(load_dir, iter_dir_name(rollout_id))
    if not os.path.isfile(os.path.join(path, "driver_state.json")):
        raise FileNotFoundError(f"--load: {pointer} names {path}, which is missing or incomplete")
    return path


def checkpoint_ids(load_dir: str) -> list[int]:
    """Rollout ids of the published `iter_*` dirs under `load_dir`, ascending."""
    ids = []
    for name in os.listdir(load_dir) if os.path.isdir(load_dir) else []:
        m = re.fullmatch(r"iter_(\d+)", name)
        if m and os.path.isdir(os.path.join(load_dir, name)):
            ids.append(int(m.group(1)))
    return sorted(ids)


def verify_checkpoint(ckpt_dir: str) -> None:
    """Cheap integrity check of every part (no tensor is read): raises `CheckpointFileError` naming the file."""
    state = read_json_file(os.path.join(ckpt_dir, "driver_state.json"))
    missing = {"rollout_id", "rollout", "rng"} - set(state if isinstance(state, dict) else {})
    if missing:
        raise CheckpointFileError(os.path.join(ckpt_dir, "driver_state.json"), f"corrupt: missing {sorted(missing)}")
    read_json_file(os.path.join(ckpt_dir, "buffer", "buffer.json"))
    trainer = os.path.join(ckpt_dir, "trainer")
    if os.path.isdir(trainer):
        if os.path.isdir(os.path.join(trainer, "torch_dist")):  # the Megatron trainer's dist-checkpoint
            check_dist_checkpoint(os.path.join(trainer, "torch_dist"))
        else:  # the FSDP trainer's full state
            check_safetensors(os.path.join(trainer, "model.safetensors"))
        for name in sorted(os.listdir(trainer)):
            if name.endswith(".pt") and not (name.startswith("rng_rank") and os.path.isfile(
                    os.path.join(trainer, "optimizer.pt"))):  # (FSDP's old pickled RNG files hold numpy types)
                check_torch_file(os.path.join(trainer, name))
            elif name.endswith(".json"):
                read_json_file(os.path.join(trainer, name))


def resolve_checkpoint(load_dir: str, step: int | None = None) -> str | None:
    """The checkpoint to resume from (`--ckpt-step`, else the newest), verified; None if none yet."""
    target = step
    try:
        if step is None:
            pointer = os.path.join(load_dir, LATEST)
            if os.path.isfile(pointer):
                text = open(pointer).read().strip()
                target = int(text) if text.isdigit() else None
            ckpt = latest_checkpoint(load_dir)
            if ckpt is None:
                return None
        else:
            ckpt = os.path.join(load_dir, iter_dir_name(step))
            if not os.path.isdir(ckpt):
                raise FileNotFoundError(f"--ckpt-step {step}: {ckpt} does not exist "
                                        f"(checkpoints under {load_dir}: {checkpoint_ids(load_dir) or 'none'})")
        verify_checkpoint(ckpt)
        return ckpt
    except (CheckpointFileError, FileNotFoundError, ValueError) as e:
        offer = _previous_intact(load_dir, target)
        hint = (f"; the previous checkpoint {offer[1]} is intact: resume from it with --ckpt-step {offer[0]}"
                if offer else "; no earlier intact checkpoint was found")
        raise CheckpointLoadError(f"--load {load_dir}: {e}{hint}") from e


def _previous_intact(load_dir: str, before: int | None) -> tuple[int, str] | None:
    for rid in reversed(checkpoint_ids(load_dir)):
        if before is not None and rid >= before:
            continue
        path = os.path.join(load_dir, iter_dir_name(rid))
        try:
            verify_checkpoint(path)
        except (CheckpointFileError, OSError):
            continue
        return rid, path
    return None


def read_driver_state(ckpt_dir: str) -> dict[str, Any]:
    return read_json_file(os.path.join(ckpt_dir, "driver_state.json"))


def data_contract(args) -> dict[str, Any]:
    """The flags a resume must keep (saved in driver_state.json)."""
    return {"n_samples_per_prompt": args.n_samples_per_prompt, "rollout_batch_size": args.rollout_batch_size}


def check_data_contract(saved: dict[str, Any] | None, args) -> None:
    """Refuse a resume whose contract flags differ from the checkpoint's (old checkpoints carry none)."""
    if not saved:
        return
    now = data_contract(args)
    diffs = [f"--{k.replace('_', '-')} was {saved[k]!r}, now {now[k]!r}" for k in CONTRACT_FLAGS
             if k in saved and saved[k] != now[k]]
    if diffs:
        raise CheckpointLoadError(
            "--load: the checkpoint was written with other data-contract flags (" + "; ".join(diffs) + "): its data "
            "position, parked groups and ledger would not match what the run now draws; resume with the saved "
            "values, or start a new run (--save elsewhere, no --load)")


def rng_state() -> dict[str, Any]:
    """The driver's Python / NumPy / torch RNG states, JSON-serialisable."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
