"""`torchvision.transforms.v2` (transformers' image processors import `functional` from it)."""

from ..._unavailable import getattr_for
from . import functional  # noqa: F401

__getattr__ = getattr_for(__name__)
