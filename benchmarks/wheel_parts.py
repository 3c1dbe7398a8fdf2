"""Wheels too big for one run to the GPU box, carried in parts over two runs and joined there.

    # on a machine with a registry: Ray's wheel split, its first part beside the other wheels in .whl/
    python benchmarks/wheel_parts.py split .whl/ray-2.52.0-cp312-cp312-manylinux2014_x86_64.whl --first-mb 24 \
        --dirs .whl .whl2
    # on the GPU box (benchmarks/gpu_main_job.sh does it): every wheel whose parts are all here, joined and checked
    python benchmarks/wheel_parts.py join --dirs .whl .whl2 --out DIR [--require ray]

`split` writes WHEEL.part1of2 (the first `--first-mb` MB) into the first dir and WHEEL.part2of2 into the second,
each beside WHEEL.sha256, and removes WHEEL. `join` concatenates the parts of each wheel found in `--dirs` when all
are present, checks the result against its sha256 and writes it to `--out`; a wheel with parts missing is listed
(its other part comes with the other run). `--require NAME`: exit 1 unless a wheel whose name starts with NAME was
joined.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

PART = re.compile(r"^(?P<wheel>.+\.whl)\.part(?P<i>\d+)of(?P<n>\d+)$")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(wheel: str, first_bytes: int, dirs: list[str]) -> list[str]:
    if len(dirs) != 2:
        raise SystemExit("split: --dirs takes two directories (one per run)")
    size = os.path.getsize(wheel)
    if not 0 < first_bytes < size:
        raise SystemExit(f"split: --first-mb must leave something for the second part ({wheel} is {size} bytes)")
    name, digest = os.path.basename(wheel), sha256(wheel)
    out = []
    with open(wheel, "rb") as f:
        for i, (d, n) in enumerate(zip(dirs, (first_bytes, size - first_bytes)), 1):
            os.makedirs(d, exist_ok=True)
            path = os.path.join(d, f"{name}.part{i}of2")
            with open(path, "wb") as g:
                g.write(f.read(n))
            with open(os.path.join(d, f"{name}.sha256"), "w") as g:
                g.write(digest + "\n")
            out.append(path)
    os.remove(wheel)
    return out


def join(dirs: list[str], out_dir: str) -> tuple[list[str], list[str]]:
    """(joined wheels' paths, messages about the incomplete ones)."""
    parts: dict[str, dict[int, str]] = {}
    totals: dict[str, int] = {}
    digests: dict[str, str] = {}
    for d in dirs:
        for entry in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            m = PART.match(entry)
            if m:
                parts.setdefault(m["wheel"], {})[int(m["i"])] = os.path.join(d, entry)
                totals[m["wheel"]] = int(m["n"])
            elif entry.endswith(".whl.sha256"):
                with open(os.path.join(d, entry)) as f:
                    digests[entry[: -len(".sha256")]] = f.read().split()[0]
    joined, missing = [], []
    os.makedirs(out_dir, exist_ok=True)
    for wheel, have in sorted(parts.items()):
        need = [i for i in range(1, totals[wheel] + 1) if i not in have]
        if need:
            missing.append(f"{wheel}: part(s) {need} of {totals[wheel]} not here (the other run carries them)")
            continue
        path = os.path.join(out_dir, wheel)
        with open(path + ".tmp", "wb") as g:
            for i in range(1, totals[wheel] + 1):
                with open(have[i], "rb") as f:
                    g.write(f.read())
        got, want = sha256(path + ".tmp"), digests.get(wheel)
        if want is None or got != want:
            os.remove(path + ".tmp")
            raise SystemExit(f"join: {wheel}: sha256 {got} of the joined parts "
                             + (f"is not {want} (a part is damaged or from another wheel)" if want else
                                "cannot be checked: no .sha256 file beside its parts"))
        os.replace(path + ".tmp", path)
        joined.append(path)
    return joined, missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("wheel")
    s.add_argument("--first-mb", type=float, required=True)
    s.add_argument("--dirs", nargs=2, required=True)
    j = sub.add_parser("join")
    j.add_argument("--dirs", nargs="+", required=True)
    j.add_argument("--out", required=True)
    j.add_argument("--require", action="append", default=[])
    opts = p.parse_args(argv)
    if opts.cmd == "split":
        for path in split(opts.wheel, int(opts.first_mb * 1e6), opts.dirs):
            print(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")
        return 0
    joined, missing = join(opts.dirs, opts.out)
    for path in joined:
        print(f"joined {os.path.basename(path)} ({os.path.getsize(path) / 1e6:.1f} MB, sha256 ok)")
    for msg in missing:
        print(msg)
    names = [os.path.basename(x) for x in joined]
    lacking = [r for r in opts.require if not any(n.startswith(r) for n in names)]
    if lacking:
        print(f"join: no complete wheel for {lacking} (both runs' parts are needed: benchmarks/README.md, 'On a GPU')",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
