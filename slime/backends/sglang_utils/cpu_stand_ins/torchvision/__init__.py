"""Stand-in for `torchvision` in SGLang's CPU server process (see ../README.md): the modules SGLang and transformers
import at start-up (`io`, `transforms`, `transforms.functional`, `transforms.v2`, `transforms.v2.functional`) exist
with torchvision's `InterpolationMode`; any other name exists too, and raises when used (only image and video
processors use them)."""

import enum
import importlib.machinery
import sys
import types

__version__ = "0.0.0+slime-stand-in"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _getattr_for(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{module}.{name}: torchvision is a stand-in in this SGLang CPU server (image models "
                               "are not served here)")

        unavailable.__name__ = name
        return unavailable

    return __getattr__


__getattr__ = _getattr_for(__name__)
for _name in ("io", "transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional"):
    _mod = types.ModuleType(f"{__name__}.{_name}")
    _mod.__spec__ = importlib.machinery.ModuleSpec(_mod.__name__, None)
    _mod.__getattr__ = _getattr_for(_mod.__name__)
    if _name != "io":
        _mod.InterpolationMode = InterpolationMode
    _parent, _, _leaf = _mod.__name__.rpartition(".")
    setattr(sys.modules[_parent], _leaf, _mod)
    sys.modules[_mod.__name__] = _mod
