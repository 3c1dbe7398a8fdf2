"""The hand-written reward corpus (tests/data/rewards/<rm_type>.txt)."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path

import pytest

from slime.rollout.rm_hub import async_rm
from slime.utils.types import Sample, Status

CORPUS_DIR = Path(__file__).parent / "data" / "rewards"
RM_TYPES = ("deepscaler", "dapo", "math")
MIN_CASES = 300
# the styles every file must cover, each with at least one right and one wrong case
REQUIRED_CATEGORIES = {
    "deepscaler": {"boxed", "think", "eos", "latex", "units", "choice", "symbolic", "structure", "decimal"},
    "dapo": {"answer_line", "think", "eos", "latex", "units", "label_number"},
    "math": {"boxed", "think", "eos", "latex", "units", "choice", "symbolic", "structure", "decimal", "label"},
}


def load_corpus(rm_type: str) -> list[tuple[str, float, str, str, str]]:
    """[(case id, expected, category, label, response)] of one corpus file; malformed lines raise, naming the line."""
    path = CORPUS_DIR / f"{rm_type}.txt"
    cases = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(" @@ ", 3)
        if len(parts) != 4:
            raise ValueError(f"{path.name}:{lineno}: expected 'reward @@ category @@ label @@ response', got {line!r}")
        expected, category, label, response = parts
        cases.append((f"{rm_type}:{lineno}", float(expected), category.strip(), label, response.replace("⏎", "\n")))
    return cases


CASES = [case for rm_type in RM_TYPES for case in load_corpus(rm_type)]


@pytest.fixture(scope="module")
def args_by_type(base_args):
    return {t: base_args.replace(rm_type=t) for t in RM_TYPES}


@pytest.mark.parametrize("rm_type", RM_TYPES)
def test_corpus_size_and_styles(rm_type):
    cases = load_corpus(rm_type)
    assert len(cases) >= MIN_CASES, f"{rm_type}: {len(cases)} cases"
    wrong = -1.0 if rm_type == "dapo" else 0.0
    seen = collections.defaultdict(set)
    for _, expected, category, _, _ in cases:
        seen[category].add(expected != wrong)
    for category in REQUIRED_CATEGORIES[rm_type]:
        assert seen[category] == {True, False}, f"{rm_type}: category {category!r} needs right and wrong cases"
    assert len({(label, response) for _, _, _, label, response in cases}) == len(cases), "duplicate cases"


@pytest.mark.parametrize("case_id, expected, category, label, response", CASES, ids=[c[0] for c in CASES])
def test_corpus_case(case_id, expected, category, label, response, args_by_type):
    rm_type = case_id.split(":")[0]
    sample = Sample(index=0, group_index=0, prompt="Q", response=response, label=label, status=Status.COMPLETED)
    got = asyncio.run(async_rm(args_by_type[rm_type], sample))
    assert got == expected, f"{case_id} [{category}] label={label!r} response={response!r}"
