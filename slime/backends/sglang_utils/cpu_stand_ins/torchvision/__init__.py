"""Stand-in for `torchvision` in SGLang's CPU server process (see ../README.md): every name exists, and raises
when used (only image and video processors use it)."""

from . import io, transforms  # noqa: F401
from ._unavailable import getattr_for

__version__ = "0.0.0+slime-stand-in"
__getattr__ = getattr_for(__name__)
