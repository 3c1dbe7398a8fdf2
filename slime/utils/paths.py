"""Can this node see the run's files? Checked on the node that needs them: `path_problems` says what is missing
there; `shared_marker` proves a directory is the same one on two nodes."""

from __future__ import annotations

import os
import socket
import uuid

SHARED_STORAGE_HINT = "multi-node runs need shared storage (the same path on every node) for the model, data and --save"


class PathNotVisibleError(RuntimeError):
    """A node of the run cannot see a path it needs; the message names the node, the flag and the path."""


def path_problems(checks: list[tuple[str, str, str]]) -> list[str]:
    """What is wrong with each (flag, path, kind) on this node; kinds: `hf_dir` (a directory with config.json),
    `dir`, `file`, `shared:<marker file name>` (a directory holding that marker, written by the driver)."""
    problems = []
    for flag, path, kind in checks:
        if kind == "hf_dir":
            if not os.path.isfile(os.path.join(path, "config.json")):
                problems.append(f"{flag} {path}: " + ("no config.json" if os.path.isdir(path) else "not found"))
        elif kind == "dir":
            if not os.path.isdir(path):
                problems.append(f"{flag} {path}: not a directory here")
        elif kind == "file":
            if not os.path.isfile(path):
                problems.append(f"{flag} {path}: not found")
        elif kind.startswith("shared:"):
            marker = os.path.join(path, kind.split(":", 1)[1])
            if not os.path.isdir(path):
                problems.append(f"{flag} {path}: not a directory here")
            elif not os.path.isfile(marker):
                problems.append(f"{flag} {path}: exists here but is not the driver's directory (a file the driver "
                                f"wrote there is missing)")
            elif not os.access(path, os.W_OK):
                problems.append(f"{flag} {path}: not writable here")
        else:
            raise ValueError(f"path_problems: unknown kind {kind!r}")
    return problems


class shared_marker:
    """`with shared_marker(dir) as name:` a uniquely named empty file in `dir` while the block runs."""

    def __init__(self, directory: str):
        self.directory = directory
        self.name = f".slime-shared-check-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> str:
        open(os.path.join(self.directory, self.name), "w").close()
        return self.name

    def __exit__(self, *exc) -> None:
        try:
            os.remove(os.path.join(self.directory, self.name))
        except OSError:
            pass
