"""Checkpoint directories, written atomically.

Layout under `--save DIR`:
    DIR/iter_0000012/            one complete checkpoint (trainer/, buffer/, driver_state.json)
    DIR/latest_checkpointed_iteration.txt   the newest complete one
A checkpoint is assembled in `DIR/iter_0000012.tmp-<pid>` and renamed into
place only when every part is written; the pointer file is replaced after
that. A crash mid-save therefore leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from typing import Any, Callable

import numpy as np
import torch

logger = logging.getLogger(__name__)

LATEST = "latest_checkpointed_iteration.txt"


def iter_dir_name(rollout_id: int) -> str:
    return f"iter_{rollout_id:07d}"


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(save_dir: str, rollout_id: int, writers: dict[str, Callable[[str], None]],
                    driver_state: dict[str, Any]) -> str:
    """Write each part with `writers[name](subdir)` into a tmp dir, then publish it atomically."""
    os.makedirs(save_dir, exist_ok=True)
    final = os.path.join(save_dir, iter_dir_name(rollout_id))
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, write in writers.items():
        sub = os.path.join(tmp, name)
        os.makedirs(sub, exist_ok=True)
        write(sub)
    _write_atomic(os.path.join(tmp, "driver_state.json"), json.dumps(driver_state))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_atomic(os.path.join(save_dir, LATEST), str(rollout_id))
    logger.info("saved checkpoint %s", final)
    return final


def latest_checkpoint(load_dir: str) -> str | None:
    """The newest complete checkpoint under `load_dir`, or None if there is none yet."""
    pointer = os.path.join(load_dir, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        text = f.read().strip()
    try:
        rollout_id = int(text)
    except ValueError as e:
        raise ValueError(f"--load: {pointer} holds {text!r}, not a rollout id") from e
    path = os.path.join(load_dir, iter_dir_name(rollout_id))
    if not os.path.isfile(os.path.join(path, "driver_state.json")):
        if os.path.isfile(os.path.join(path, "metadata.json")):
            raise FileNotFoundError(f"--load: {load_dir} is a model-only torch_dist checkpoint (as "
                                    "tools/convert_hf_to_torch_dist.py writes), not a train.py checkpoint; "
                                    "pass it as --ref-load")
        raise FileNotFoundError(f"--load: {pointer} names {path}, which is missing or incomplete")
    return path


def read_driver_state(ckpt_dir: str) -> dict[str, Any]:
    with open(os.path.join(ckpt_dir, "driver_state.json")) as f:
        return json.load(f)


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
