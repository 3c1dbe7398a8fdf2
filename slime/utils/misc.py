"""Small shared helpers."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def load_function(path: str) -> Callable[..., Any]:
    """Import `package.module.attr` and return the attribute; errors name the path."""
    module_path, _, attr = path.rpartition(".")
    if not module_path:
        raise ValueError(f"{path!r} is not a dotted path of the form package.module.function")
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ImportError(f"cannot import module {module_path!r} for plugin {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ImportError(f"module {module_path!r} has no attribute {attr!r} (plugin {path!r})") from e
