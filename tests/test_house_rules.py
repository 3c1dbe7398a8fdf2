"""The house's structure, checked."""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {"utils": 1, "tasks": 1, "backends": 2, "rollout": 3, "ray": 4}
# `getattr(args, ...)` is allowed only where a plugin's contract makes a value optional; list such places here
# (file, reason) so that every exception is written down.
GETATTR_ALLOWED: dict[str, str] = {}


def _py_files(*tops: str) -> list[str]:
    out = []
    for top in tops:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            out.append(path)
            continue
        for d, _, files in os.walk(path):
            out += [os.path.join(d, f) for f in files if f.endswith(".py")]
    return sorted(out)


def _module_of(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str) -> set[str]:
    """Every slime module `path` imports, at the top or inside functions (lazy imports count too)."""
    tree = ast.parse(open(path).read(), path)
    mods: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.startswith("slime"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("slime") and node.level == 0:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)  # `from slime.x import module`
    return mods


def _graph() -> dict[str, set[str]]:
    files = {_module_of(p): p for p in _py_files("slime")}
    graph = {}
    for mod, path in files.items():
        graph[mod] = {m for m in _imports(path) if m in files and m != mod}
    return graph


def _floor(mod: str) -> int | None:
    parts = mod.split(".")
    return FLOORS.get(parts[1]) if len(parts) > 2 else None


def test_no_getattr_defaults_for_flags():
    pattern = re.compile(r"getattr\(\s*(self\.)?_?args\s*,")
    offenders = []
    for path in _py_files("slime", "train.py", "train_async.py", "tools", "benchmarks"):
        rel = os.path.relpath(path, ROOT)
        if rel in GETATTR_ALLOWED or rel.startswith(os.path.join("slime", "arguments") + os.sep):
            continue
        for i, line in enumerate(open(path), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{i}: {line.strip()}")
    assert not offenders, "read flags as args.name (defaults live in slime/arguments/):\n" + "\n".join(offenders)


def test_floors_only_look_down():
    graph = _graph()
    up = []
    for mod, deps in graph.items():
        here = _floor(mod)
        for dep in deps:
            flags = dep == "slime.arguments" or dep.startswith("slime.arguments.")
            if flags and not mod.startswith("slime.arguments"):
                up.append(f"{mod} imports slime.arguments (entry points parse flags; modules take args)")
            there = _floor(dep)
            if here is not None and there is not None and there > here:
                up.append(f"{mod} (floor {here}) imports {dep} (floor {there})")
    assert not up, "imports that climb back up:\n" + "\n".join(sorted(up))


# backends and the folders each may use besides its own: the trainers share training_utils (weight sync included),
# which reaches the engines through sglang_utils' protocol client; sglang_utils' launcher starts either engine
# (the embedded one's command line included); no trainer backend imports another, an engine or the launcher
BACKEND_USES = {"fsdp_utils": {"training_utils"}, "megatron_utils": {"training_utils"},
                "training_utils": {"sglang_utils"}, "sglang_utils": {"hf_engine"}, "hf_engine": set()}


def test_no_backend_imports_another():
    graph = _graph()
    across = []
    for mod, deps in graph.items():
        parts = mod.split(".")
        if len(parts) < 3 or parts[1] != "backends" or parts[2] not in BACKEND_USES:
            continue
        for dep in deps:
            d = dep.split(".")
            if len(d) >= 3 and d[1] == "backends" and d[2] != parts[2] and d[2] not in BACKEND_USES[parts[2]]:
                across.append(f"{mod} imports {dep}")
    assert not across, "a backend imports another:\n" + "\n".join(sorted(across))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_default_rollout_function_loads_no_simulator():
    """`--over-sampling-batch-size auto`'s planner is imported only when auto is asked for."""
    import subprocess
    import sys

    code = "import sys, slime.rollout.sglang_rollout; print([m for m in sys.modules if 'simulator' in m])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"importing slime.rollout.sglang_rollout loaded {out.stdout.strip()}"


def test_args_replace_refuses_unknown_flags(base_args):
    import pytest

    with pytest.raises(AttributeError, match="rollout_batch_sise"):
        base_args.replace(rollout_batch_sise=3)
    with pytest.raises(AttributeError):
        _ = base_args.rollout_batch_sise  # a misspelt read fails loudly, no silent default
    assert base_args.replace(rollout_batch_size=3).rollout_batch_size == 3


# --- no test bounds a wall-clock duration ("a test that waits for an event waits for the event") ---
CLOCK_CALLS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns", "process_time"}
# a measured duration by its name: elapsed, waited, took, duration, dt, or a lowercase *_s / *_ms / *_secs /
# *_seconds value (UPPER_CASE names are limits a test sets, not measurements)
DURATION_NAME = re.compile(r"(^|_)(elapsed|waited|took|duration)($|_)|^[a-z0-9_/]*_(s|ms|secs|seconds)$|^dt$")
# files whose durations are not wall-clock, each with its reason
TIMED_ASSERTS_ALLOWED: dict[str, str] = {
    "tests/test_simulator.py": "the simulator runs a simulated clock: its durations and rates are deterministic results",
}


def _is_clock_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)) in CLOCK_CALLS


def _duration_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value.rsplit("/", 1)[-1]  # a metric such as m["rollout/drain_s"]
    return None


def _is_duration(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and (_is_clock_call(node.left)
                                                                         or _is_clock_call(node.right)):
        return True  # time.monotonic() - t0
    name = _duration_name(node)
    return bool(name and DURATION_NAME.search(name))


def _same_record(a: ast.AST, b: ast.AST) -> bool:
    """tr["drained_t"] <= tr["step_time_s"]: two marks of one record in order, not a bound."""
    return isinstance(a, ast.Subscript) and isinstance(b, ast.Subscript) and ast.dump(a.value) == ast.dump(b.value)


def timed_asserts(source: str, filename: str = "<test>") -> list[tuple[int, str]]:
    """(line, text) of each assert that orders a measured duration against anything but 0."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in ast.walk(node.test):
            if not isinstance(cmp, ast.Compare):
                continue
            operands = [cmp.left, *cmp.comparators]
            for op, a, b in zip(cmp.ops, operands, operands[1:]):
                if not isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) or _same_record(a, b):
                    continue
                zero = [isinstance(x, ast.Constant) and x.value == 0 and type(x.value) is not bool for x in (a, b)]
                if (_is_duration(a) and not zero[1]) or (_is_duration(b) and not zero[0]):
                    found.append((cmp.lineno, ast.get_source_segment(source, cmp)))
                    break
    return found


def test_no_test_bounds_a_wall_clock_duration():
    offenders = []
    for path in _py_files("tests"):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        if rel.count("/") != 1 or rel in TIMED_ASSERTS_ALLOWED:
            continue
        offenders += [f"{rel}:{line}: assert ... {text}" for line, text in timed_asserts(open(path).read(), rel)]
    assert not offenders, ("asserts that bound a wall-clock duration (flaky on a loaded box; assert the event or its "
                           "cause instead, e.g. the error naming the deadline, a log line, a cancelled wait):\n"
                           + "\n".join(offenders))


def test_the_timed_assert_scan_tells_bounds_from_legit_uses():
    flagged = [  # (written so that a grep for the old forms finds none in this file)
        "assert 5 > elapsed",
        "assert time.monotonic() - start < 10  # not the 120 s timeout",
        "assert 'error' in result and time.monotonic() - start <= 10",
        "assert 60 > faulty_run['replaced_after_s']",
        "assert res == 0.01 and 1.0 > waited",
        "assert 0 <= elapsed_s < 30",
        "assert m['rollout/drain_s'] < SLOW_HOLD_S",
        "assert time.monotonic() - start >= SLOW_HOLD_S",
        "assert not t.is_alive() and time.perf_counter() - start < 30",
        "assert 2.0 > took",
    ]
    legit = [
        "assert time.monotonic() < deadline, 'engines never both busy'",  # a safety net that fails with a message
        "assert m['rollout/drain_s'] >= 0",
        "assert 0 <= tr['first_request_t'] <= tr['drained_t'] <= tr['step_time_s']",  # marks of one record, in order
        "assert len(r['output_ids']) < 900",
        "assert updater.buffer_bytes < 1 << 15",
        "assert SLOW_HOLD_S < TIMEOUT_S",
        "assert out['timeout_s'] == 30",
        "while time.monotonic() - start < 5:\n    pass",  # not an assert
    ]
    assert [src for src in flagged if not timed_asserts(src)] == []
    assert [src for src in legit if timed_asserts(src)] == []


COLLECTIVES = {"broadcast", "all_reduce", "all_gather", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"}


def _host_tensors_in_collectives(source: str, path: str) -> list[str]:
    """`dist.<collective>(t, ...)` where `t` was made in the same function by `torch.tensor/zeros/...(...)` without
    `device=`: a CPU tensor, which NCCL (the trainers' default group on GPUs) refuses ("No backend type associated
    with device type cpu"). Gloo takes it, so only a GPU run would find it."""
    bad = []
    for fn in ast.walk(ast.parse(source, path)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        made: dict[str, ast.Call] = {}
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                    and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                    and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "torch"
                    and node.value.func.attr in ("tensor", "zeros", "ones", "empty", "full")):
                made[node.targets[0].id] = node.value
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in made
                    and not any(k.arg == "device" for k in made[node.args[0].id].keywords)):
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {fn.name}: dist.{node.func.attr}"
                           f"({node.args[0].id}) on a tensor made without device=")
    return bad


def test_collectives_get_device_tensors():
    # found on an H100 (2026-11-27): the weight updater's rank agreement broadcast a CPU tensor, and the colocated
    # main job stopped at its first weight push
    bad = [b for path in _py_files("slime") for b in _host_tensors_in_collectives(open(path).read(), path)]
    assert not bad, bad


def test_the_collective_scan_finds_a_host_tensor():
    src = ("def f():\n    t = torch.tensor([1], dtype=torch.int64)\n    dist.broadcast(t, src=0)\n"
           "def g():\n    t = torch.tensor([1], device=device())\n    dist.all_reduce(t)\n")
    assert [b.split(" ", 1)[1] for b in _host_tensors_in_collectives(src, os.path.join(ROOT, "x.py"))] == [
        "f: dist.broadcast(t) on a tensor made without device="]
