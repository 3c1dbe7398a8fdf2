"""`torchvision.transforms.functional`: `InterpolationMode` (torchvision's values); every other name raises when used."""

import enum

from .._unavailable import getattr_for


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = getattr_for(__name__)
