"""`torchvision.io` (transformers' image_utils / video_utils import `ImageReadMode`, `decode_image`, ...)."""

from ._unavailable import getattr_for

__getattr__ = getattr_for(__name__)
