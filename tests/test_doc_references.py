"""Every file the docs and the code's comments point at exists."""

from __future__ import annotations

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A repository-relative path: one of our top-level folders, then name characters; `{a,b}` and `*` are expanded.
REFERENCE = re.compile(r"(?<![\w./-])((?:slime|docs|scripts|tools|benchmarks|tests|docker|\.ci)/[\w.*{},/-]*[\w*}])")
# Paths that name upstream slime's files, not ours (the line says so where they appear).
UPSTREAM = {"slime/utils/arguments.py", "docs/en/get_started/customization.md", "scripts/run-qwen3-4B.sh",
            "slime/backends/sglang_utils/arguments.py"}
DOCS = ("README.md", "docs/*.md", "benchmarks/*.md")
SOURCES = ("*.py", "slime/**/*.py", "tools/*.py", "benchmarks/*.py", "tests/*.py", "scripts/**/*.sh",
           "benchmarks/*.sh", ".ci/run")


def expand(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]


def exists(path: str) -> bool:
    if glob.glob(os.path.join(REPO, path)):
        return True
    # `slime/utils/gc_utils.freeze_gc_heap`: a module's attribute
    module, _, attr = path.rpartition(".")
    return bool(module) and "/" not in attr and os.path.isfile(os.path.join(REPO, module + ".py"))


def references(patterns) -> list[tuple[str, int, str]]:
    found = []
    for pattern in patterns:
        for name in sorted(glob.glob(os.path.join(REPO, pattern), recursive=True)):
            rel = os.path.relpath(name, REPO)
            with open(name, encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    for m in REFERENCE.finditer(line):
                        found.append((rel, lineno, m.group(1).rstrip(".,")))
    return found


def dangling(patterns) -> list[str]:
    return [f"{rel}:{lineno}: {ref}" for rel, lineno, ref in references(patterns)
            if ref not in UPSTREAM and rel != os.path.relpath(__file__, REPO) and not all(exists(p) for p in expand(ref))]


def test_the_reference_pattern_finds_paths_and_expands_braces():
    line = "see slime/rollout/step.py, docs/metrics.md and slime/backends/{fsdp,megatron}_utils/ (not foo/slime/x.py)"
    refs = [m.group(1) for m in REFERENCE.finditer(line)]
    assert refs == ["slime/rollout/step.py", "docs/metrics.md", "slime/backends/{fsdp,megatron}_utils"]
    assert expand(refs[2]) == ["slime/backends/fsdp_utils", "slime/backends/megatron_utils"]
    assert exists("slime/rollout/step.py") and not exists("slime/rollout/no_such_module.py")


def test_docs_reference_only_files_that_exist():
    assert not dangling(DOCS), "dangling references in the docs:\n" + "\n".join(dangling(DOCS))


def test_code_comments_reference_only_files_that_exist():
    assert not dangling(SOURCES), "dangling references in the code:\n" + "\n".join(dangling(SOURCES))


def test_readme_is_a_map_under_12_kb_and_links_every_doc():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.encode()) <= 12 * 1024, f"README.md is {len(readme.encode())} bytes"
    for doc in sorted(glob.glob(os.path.join(REPO, "docs", "*.md"))) + [os.path.join(REPO, "benchmarks", "README.md")]:
        rel = os.path.relpath(doc, REPO)
        assert rel in readme, f"README.md does not link {rel}"


METRIC = re.compile(r"""f?["']((?:rollout|reward|eval|train|weight_sync|colocate|engine|ledger|perf|async)/[\w{}/]*)["']""")


def logged_keys() -> set[str]:
    """Metric keys written in the code: literal ones, and f-string templates cut at their first placeholder."""
    keys = set()
    for pattern in ("slime/**/*.py", "train.py", "train_async.py"):
        for name in glob.glob(os.path.join(REPO, pattern), recursive=True):
            with open(name, encoding="utf-8") as f:
                for m in METRIC.finditer(f.read()):
                    keys.add(m.group(1).split("{")[0])
    return keys


def test_docs_metrics_names_every_logged_key():
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as f:
        doc = f.read()
    keys = logged_keys()
    assert "rollout/off_policy_token_ratio" in keys and "rollout/staleness_hist/lag_" in keys
    missing = sorted(k for k in keys if f"`{k}" not in doc)
    assert not missing, f"docs/metrics.md does not explain: {missing}"
