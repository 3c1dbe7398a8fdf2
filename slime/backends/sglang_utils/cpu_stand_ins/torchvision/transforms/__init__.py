"""`torchvision.transforms`: `InterpolationMode` and `functional`, `v2`; every other name raises when used."""

from .._unavailable import getattr_for
from . import functional, v2  # noqa: F401
from .functional import InterpolationMode  # noqa: F401

__getattr__ = getattr_for(__name__)
