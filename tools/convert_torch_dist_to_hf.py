"""A Megatron torch_dist checkpoint as a Hugging Face model directory (slime's command line).

    python tools/convert_torch_dist_to_hf.py --input-dir OUT_DIR/iter_xxx --output-dir HF_OUT --origin-hf-dir HF_DIR

--input-dir: what tools/convert_hf_to_torch_dist.py wrote (OUT_DIR or OUT_DIR/iter_0000000), or a
checkpoint of train.py --train-backend megatron (SAVE/iter_NNNNNNN). The config and tokenizer come from
--origin-hf-dir, the weights (in its dtype) from the checkpoint, whatever TP it was saved at.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.arguments import megatron_flags  # noqa: E402
from slime.backends.megatron_utils.convert import torch_dist_to_hf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-dir", required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--origin-hf-dir", required=True, help="the HF model the checkpoint was made from")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        torch_dist_to_hf(megatron_flags(), a.input_dir, a.output_dir, a.origin_hf_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"convert_torch_dist_to_hf.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
