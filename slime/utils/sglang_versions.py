"""The SGLang versions we build against, written once (standard library only: setup.py reads it). Supported:
SGLANG_OLDEST (upstream slime's pin) to SGLANG_PINNED, both tested; others are refused at start-up."""

from __future__ import annotations

import re

SGLANG_PINNED = "0.5.23"  # docker/Dockerfile's base image (lmsysorg/sglang:v0.5.23-...)
SGLANG_OLDEST = "0.5.15.post1"  # upstream slime's pin

CONTRACT_VERSIONS = (SGLANG_PINNED, SGLANG_OLDEST)

# What the contract tests install next to each `sglang` wheel (pip --no-deps): what SGLang pins itself.
CONTRACT_COMMON_PACKAGES = (
    "msgspec==0.22.0", "pybase64==1.5.1", "uvloop==0.23.0", "pyzmq==27.3.0", "python-multipart==0.0.34",
    "gguf==0.19.0", "scipy==1.17.1", "jiter==0.19.0",
)
CONTRACT_VERSION_PACKAGES = {
    "0.5.23": ("openai==2.8.0",),
    "0.5.15.post1": ("openai==2.6.1",),
}


# SGLang pins transformers per release (0.5.23: 5.19.0; 0.5.15.post1: 5.12.1): ours holds both ends.
TRANSFORMERS_REQUIREMENT = "transformers>=5.12.1,<6"


def version_key(version: str) -> tuple:
    """0.5.15.post1 -> (0, 5, 15, 1): releases, then their post-releases, compare in order."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?(?:(?:rc|a|b|\.dev)\d*)?(?:[+-].*)?", version.strip())
    if m is None:
        raise ValueError(f"not an SGLang release version: {version!r}")
    return tuple(int(g or 0) for g in m.groups())


def is_supported(version: str) -> bool:
    try:
        key = version_key(version)
    except ValueError:
        return False
    return version_key(SGLANG_OLDEST) <= key <= version_key(SGLANG_PINNED)


def supported_range() -> str:
    return f"SGLang {SGLANG_OLDEST} to {SGLANG_PINNED}"


def sglang_requirement() -> str:
    """setup.py's `sglang` extra."""
    return f"sglang>={SGLANG_OLDEST},<={SGLANG_PINNED}"
