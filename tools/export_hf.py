"""Export a training checkpoint as a plain Hugging Face model directory.

    python tools/export_hf.py --load CKPT_DIR --out HF_DIR [--iteration N]

CKPT_DIR is what `train.py --save` wrote; the newest complete checkpoint is used
unless --iteration is given. The FSDP trainer already stores full (unsharded)
weights as safetensors with the model config; this copies them together with
the tokenizer files of the run's --hf-checkpoint, so `from_pretrained(HF_DIR)`
and `--hf-checkpoint HF_DIR` work. A Megatron checkpoint (torch_dist) is
converted (as tools/convert_torch_dist_to_hf.py does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.backends.training_utils.weight_sync import TOKENIZER_FILES  # noqa: E402
from slime.utils.checkpoint import iter_dir_name, latest_checkpoint  # noqa: E402

logger = logging.getLogger("export_hf")


def export(load_dir: str, out_dir: str, iteration: int | None = None) -> str:
    ckpt = os.path.join(load_dir, iter_dir_name(iteration)) if iteration is not None else latest_checkpoint(load_dir)
    if ckpt is None:
        raise FileNotFoundError(f"--load {load_dir}: no checkpoint found")
    trainer = os.path.join(ckpt, "trainer")
    meta_file = os.path.join(trainer, "trainer_meta.json")
    if os.path.isfile(meta_file):
        with open(meta_file) as f:
            meta = json.load(f)
        if meta.get("backend") == "megatron":  # a torch_dist checkpoint: convert it
            from slime.arguments import megatron_flags
            from slime.backends.megatron_utils.convert import torch_dist_to_hf

            torch_dist_to_hf(megatron_flags(), trainer, out_dir, meta["hf_checkpoint"])
            logger.info("exported %s to %s", ckpt, out_dir)
            return out_dir
    for name in ("config.json", "model.safetensors", "trainer_meta.json"):
        if not os.path.isfile(os.path.join(trainer, name)):
            raise FileNotFoundError(f"--load: {trainer} has no {name}; is it a train.py checkpoint?")
    with open(os.path.join(trainer, "trainer_meta.json")) as f:
        base = json.load(f).get("hf_checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(os.path.join(trainer, name), os.path.join(out_dir, name))
    copied = [n for n in TOKENIZER_FILES if base and os.path.isfile(os.path.join(base, n))]
    for name in copied:
        shutil.copy2(os.path.join(base, name), os.path.join(out_dir, name))
    if not copied:
        logger.warning("no tokenizer files found in the run's --hf-checkpoint %r; copy them by hand", base)
    logger.info("exported %s to %s", ckpt, out_dir)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the --save directory of a run")
    p.add_argument("--out", required=True, help="where to write the Hugging Face directory")
    p.add_argument("--iteration", type=int, default=None, help="rollout id of the checkpoint (default: newest)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    export(a.load, a.out, a.iteration)
    return 0


if __name__ == "__main__":
    sys.exit(main())
