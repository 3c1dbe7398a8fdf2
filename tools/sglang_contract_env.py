"""SGLang's own code for the contract tests (`pytest -m sglang_contract`), installed beside the project.

    python tools/sglang_contract_env.py install     # every version in CONTRACT_VERSIONS (skips what is there)
    python tools/sglang_contract_env.py install --background LOG   # returns once the install holds its lock
    python tools/sglang_contract_env.py paths 0.5.23

Two SGLang versions cannot share one site-packages, and SGLang's own requirements (CUDA torch, its kernels) must
not touch ours, so each version goes into its own folder with `pip install --no-deps --target`, next to one
folder of the few pure-Python / CPU packages its modules import (slime/utils/sglang_versions.py lists
them, pinned). A test puts those folders first on a server process's sys.path (tests/sglang_real_server.py).
Root: $SLIME_SGLANG_CONTRACT_DIR, default <repo>/.cache/sglang-contract (git-ignored). A folder is complete when
its stamp names exactly what it was installed from; anything else is reinstalled.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from slime.utils import sglang_versions as versions  # noqa: E402

logger = logging.getLogger("sglang_contract_env")
STAMP = ".slime-contract-stamp.json"


def root() -> str:
    return os.environ.get("SLIME_SGLANG_CONTRACT_DIR") or os.path.join(REPO, ".cache", "sglang-contract")


def _packages(folder: str) -> tuple[str, ...]:
    if folder == "common":
        return versions.CONTRACT_COMMON_PACKAGES
    return (f"sglang=={folder}", *versions.CONTRACT_VERSION_PACKAGES.get(folder, ()))


def _complete(folder: str) -> bool:
    try:
        with open(os.path.join(root(), folder, STAMP)) as f:
            return json.load(f) == {"packages": list(_packages(folder)), "python": list(sys.version_info[:2])}
    except (OSError, ValueError):
        return False


def site_dirs(version: str) -> list[str]:
    """The sys.path entries for SGLang `version`, first to last."""
    return [os.path.join(root(), version), os.path.join(root(), "common")]


def _lock_path() -> str:
    return os.path.join(root(), ".install.lock")


def is_installed(version: str) -> bool:
    """Whether `version` is complete, once an install in progress has ended (scripts/test.sh runs it in the
    background while the tests start)."""
    if os.path.exists(_lock_path()):
        with open(_lock_path()) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    return _complete(version) and _complete("common")


def _install(folder: str) -> str:
    if _complete(folder):
        return f"{folder}: already installed"
    target = os.path.join(root(), folder)
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--disable-pip-version-check",
           "--target", target, *_packages(folder)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"installing {' '.join(_packages(folder))} into {target} failed:\n{proc.stderr[-3000:]}")
    # byte-compile now, on every core: a server imports ~2,000 of these modules, and where Python does not write
    # bytecode itself (PYTHONDONTWRITEBYTECODE) each start would compile them all again (~4 s each)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", target], capture_output=True, timeout=900)
    with open(os.path.join(target, STAMP), "w") as f:
        json.dump({"packages": list(_packages(folder)), "python": list(sys.version_info[:2])}, f)
    return f"{folder}: installed {' '.join(_packages(folder))}"


def install(vers: tuple[str, ...] = versions.CONTRACT_VERSIONS, background_log: str | None = None) -> None:
    """Install under the lock is_installed() waits on. With `background_log`, return as soon as the lock is held and
    install in a child process (its own session, logging to that file), which keeps the lock until it is done."""
    os.makedirs(root(), exist_ok=True)
    lock = open(_lock_path(), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    if background_log is not None:
        if os.fork():
            return  # the child holds the lock (the same open file) until it exits
        os.setsid()
        log = os.open(background_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        logging.basicConfig(level=logging.INFO, format="[sglang-contract] %(message)s", force=True,
                            stream=sys.stderr)
        try:
            _install_all(vers)
        except Exception:  # noqa: BLE001 - the log says why; the tests find the version missing
            logger.exception("install failed")
            os._exit(1)
        os._exit(0)
    _install_all(vers)
    lock.close()


def _install_all(vers: tuple[str, ...]) -> None:
    with ThreadPoolExecutor(max_workers=len(vers) + 1) as pool:
        for line in pool.map(_install, ["common", *vers]):
            logger.info("%s", line)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[sglang-contract] %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="install every contract version (idempotent)")
    inst.add_argument("--background", metavar="LOG", default=None,
                      help="return once the install holds its lock; it goes on in the background, logging to LOG")
    paths = sub.add_parser("paths", help="print the sys.path folders of one version")
    paths.add_argument("version", choices=versions.CONTRACT_VERSIONS)
    a = p.parse_args()
    if a.cmd == "install":
        install(background_log=a.background)
    else:
        print(os.pathsep.join(site_dirs(a.version)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
