"""`torchvision.transforms.v2.functional`: every name raises when used."""

from ..functional import InterpolationMode  # noqa: F401
from ..._unavailable import getattr_for

__getattr__ = getattr_for(__name__)
