"""SGLang's own server on a CPU box: its own venv, built by the project (one command, cached, idempotent).

    python tools/sglang_cpu_env.py install      # builds <root>/0.5.23/ once; later calls return at once
    python tools/sglang_cpu_env.py python       # prints the venv's interpreter (for --sglang-python)
    python tools/sglang_cpu_env.py install --all                    # both ends of the range (scripts/test.sh)

Both ends of the supported range serve on CPU this way: the pinned SGLang (0.5.23) and the oldest (0.5.15.post1),
each with its own pinned list.
    SLIME_SGLANG_PYTHON=$(python tools/sglang_cpu_env.py python) python train.py --rollout-backend sglang ...

SGLang pins its own dependencies (CUDA torch 2.14.1, its GPU kernels: ~10 GB if pip resolves them), which ours
must not follow, so it gets a venv of its own, and nothing in it is resolved: every package is pinned in
tools/sglang_cpu_requirements/<version>.txt and installed with `pip --no-deps`, after the CPU build of torch
($TORCH_SPEC, default torch==2.13.0, as scripts/install.sh). Two packages SGLang imports cannot run on a CPU
torch; their stand-ins are the project's (slime/backends/sglang_utils/cpu_stand_ins/) and the launcher puts them
on the server's PYTHONPATH. Root: $SLIME_SGLANG_CPU_DIR, default <repo>/.cache/sglang-cpu (git-ignored). A venv
is complete when its stamp names exactly what it was installed from; anything else is rebuilt. Concurrent calls
(two pytest workers, scripts/test.sh's background install) wait on one lock: the second finds it complete.
Measured on the 2-core box: 1-4 min per version with pip's cache warm (loaded box: 235 s), 4-6 min cold (~330 MB of
downloads); ~2.8 GB on disk per version.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from slime.utils.sglang_versions import CONTRACT_VERSIONS, SGLANG_PINNED  # noqa: E402

logger = logging.getLogger("sglang_cpu_env")
STAMP = ".slime-sglang-cpu-stamp.json"
REQUIREMENTS_DIR = os.path.join(REPO, "tools", "sglang_cpu_requirements")


def root() -> str:
    return os.environ.get("SLIME_SGLANG_CPU_DIR") or os.path.join(REPO, ".cache", "sglang-cpu")


def venv_dir(version: str = SGLANG_PINNED) -> str:
    return os.path.join(root(), version)


def python(version: str = SGLANG_PINNED) -> str:
    """The venv's interpreter (it exists once `install` has run)."""
    return os.path.join(venv_dir(version), "bin", "python")


def requirements(version: str = SGLANG_PINNED) -> str:
    path = os.path.join(REQUIREMENTS_DIR, f"{version}.txt")
    if not os.path.exists(path):
        raise SystemExit(f"no pinned package list for SGLang {version} ({path})")
    return path


def _torch_spec() -> str:
    return os.environ.get("TORCH_SPEC") or "torch==2.13.0"


def _wanted(version: str) -> dict:
    with open(requirements(version), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {"sglang": version, "requirements_sha256": digest, "torch": _torch_spec(),
            "python": list(sys.version_info[:2])}


def is_installed(version: str = SGLANG_PINNED) -> bool:
    try:
        with open(os.path.join(venv_dir(version), STAMP)) as f:
            return json.load(f) == _wanted(version) and os.path.exists(python(version))
    except (OSError, ValueError):
        return False


def _pinned_names(version: str) -> set[str]:
    with open(requirements(version)) as f:
        return {ln.split("==")[0].strip().lower() for ln in f if "==" in ln and not ln.lstrip().startswith("#")}


def _site_packages(venv: str) -> str:
    return os.path.join(venv, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")


def _seed_from_sibling(version: str) -> str | None:
    """Hard links of a complete venv of another version that pins the same packages (the two ends of the range
    differ in 6 of 115 pins): pip then replaces only those, instead of unpacking torch and the rest again (0.5.15.post1
    on the 2-core box at load 7-10: 72 s instead of 144 s). pip replaces a file by unlinking it, so the sibling keeps its own."""
    for other in CONTRACT_VERSIONS:
        if other == version or not is_installed(other) or _pinned_names(other) != _pinned_names(version):
            continue
        cp = subprocess.run(["cp", "-a", "-l", "-n", _site_packages(venv_dir(other)) + "/.",
                             _site_packages(venv_dir(version))], capture_output=True, text=True)
        if cp.returncode == 0:
            return other
        logger.info("SGLang %s CPU venv: not seeded from %s (%s); installing every package", version, other,
                    cp.stderr.strip()[-300:])
    return None


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({' '.join(cmd[:6])} ...):\n{(proc.stderr or proc.stdout)[-3000:]}")


def install(version: str = SGLANG_PINNED) -> str:
    """Build the venv for SGLang `version` unless it is complete; returns its interpreter."""
    os.makedirs(root(), exist_ok=True)
    with open(os.path.join(root(), f".{version}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent install finishes first; then this one finds it complete
        if is_installed(version):
            logger.info("SGLang %s CPU venv: already installed (%s)", version, venv_dir(version))
            return python(version)
        t0 = time.monotonic()
        target = venv_dir(version)
        shutil.rmtree(target, ignore_errors=True)
        _run([sys.executable, "-m", "venv", target], "creating the venv")
        seeded = _seed_from_sibling(version)
        _run([python(version), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
              _torch_spec(), "-r", requirements(version)], f"installing SGLang {version}'s pinned packages")
        with open(os.path.join(target, STAMP), "w") as f:
            json.dump(_wanted(version), f)
        logger.info("SGLang %s CPU venv installed in %.0f s (%s%s)", version, time.monotonic() - t0, target,
                    f", seeded from {seeded}'s" if seeded else "")
        return python(version)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[sglang-cpu] %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["install", "python", "check"],
                   help="install: build the venv (idempotent); python: print its interpreter; check: exit 1 unless "
                        "it is installed")
    p.add_argument("--version", choices=CONTRACT_VERSIONS, default=SGLANG_PINNED, help="the SGLang version")
    p.add_argument("--all", action="store_true",
                   help=f"install: every supported end ({', '.join(CONTRACT_VERSIONS)}), the pinned first (the tests)")
    a = p.parse_args()
    if a.cmd == "install":
        for version in CONTRACT_VERSIONS if a.all else [a.version]:
            install(version)
    elif a.cmd == "check":
        return 0 if is_installed(a.version) else 1
    else:
        print(python(a.version))
    return 0


if __name__ == "__main__":
    sys.exit(main())
