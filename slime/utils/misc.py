"""Small shared helpers."""

from __future__ import annotations

import asyncio
import concurrent.futures
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


class SingletonMeta(type):
    """Upstream slime's one-instance-per-process metaclass, kept for plugins written against upstream."""

    def __call__(cls, *args, **kwargs):
        instance = cls.__dict__.get("_singleton_instance")
        if instance is None:
            instance = super().__call__(*args, **kwargs)
            type.__setattr__(cls, "_singleton_instance", instance)
        return instance

    def clear_instances(cls) -> None:
        if "_singleton_instance" in cls.__dict__:
            type.__delattr__(cls, "_singleton_instance")


def run_sync(coro):
    """Run `coro` to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout") as pool:
        return pool.submit(asyncio.run, coro).result()
