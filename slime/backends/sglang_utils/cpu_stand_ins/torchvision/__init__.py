"""Stand-in for `torchvision` in SGLang's CPU server process (see ../README.md).

Imported at module level while the server starts by `sglang/srt/multimodal/internvl_utils.py`
(`torchvision.transforms`, `torchvision.transforms.functional.InterpolationMode`) and
`sglang/srt/configs/deepseek_ocr.py` (`torchvision.transforms.InterpolationMode`, `.functional`); transformers 5.19,
which SGLang imports, then finds a torchvision and imports `torchvision.io`, `torchvision.transforms.v2.functional`
and `torchvision.transforms.functional.pil_to_tensor` too. The registry's torchvision is a CUDA build whose import
fails on a CPU torch. Only image and video processors use it: every name exists, and raises when used.
"""

from . import io, transforms  # noqa: F401
from ._unavailable import getattr_for

__version__ = "0.0.0+slime-stand-in"
__getattr__ = getattr_for(__name__)
