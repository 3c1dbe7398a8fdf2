"""A Hugging Face model directory as a Megatron torch_dist checkpoint (slime's command line).

    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint HF_DIR --save OUT_DIR

MODEL_ARGS as in scripts/models/*.sh (each flag is checked against HF_DIR/config.json; all optional).
Writes OUT_DIR/iter_0000000/ and OUT_DIR/latest_checkpointed_iteration.txt; train.py takes OUT_DIR as
--ref-load (the reference model, and the actor's starting point when --load has no checkpoint).
The stored tensors do not depend on TP, so one process converts any model (CPU is fine); add --bf16
to store bf16 weights. Under torchrun, --tensor-model-parallel-size splits the work.
"""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.arguments import megatron_flags  # noqa: E402
from slime.backends.megatron_utils.convert import hf_to_torch_dist  # noqa: E402


def _paths(p) -> None:
    p.add_argument("--hf-checkpoint", required=True, help="the Hugging Face model directory")
    p.add_argument("--save", required=True, help="the torch_dist checkpoint directory to write")


def main(argv=None) -> int:
    args = megatron_flags(sys.argv[1:] if argv is None else argv, __doc__, _paths)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        hf_to_torch_dist(args, args.hf_checkpoint, args.save)
    except (ValueError, FileNotFoundError) as e:
        print(f"convert_hf_to_torch_dist.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
