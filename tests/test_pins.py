"""Our requirements hold SGLang's own pins at both ends of the supported range."""

from __future__ import annotations

import ast
import os
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from slime.utils import sglang_versions as versions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import sglang_contract_env  # noqa: E402


def our_requirements() -> dict[str, Requirement]:
    """setup.py's install_requires (literal strings, and the ones it reads from slime/utils/sglang_versions.py)."""
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    listed = next(k.value for k in call.keywords if k.arg == "install_requires")
    out = {}
    for item in listed.elts:
        if isinstance(item, ast.Subscript):  # _versions["NAME"]
            text = vars(versions)[item.slice.value]
        else:
            text = item.value
        req = Requirement(text)
        out[canonicalize_name(req.name)] = req
    return out


def sglang_pins(requires: list[str]) -> dict[str, str]:
    """{package: version} for every `name==version` SGLang requires unconditionally."""
    pins = {}
    for line in requires:
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact and req.marker is None:
            pins[canonicalize_name(req.name)] = exact[0]
    return pins


def contract_requires(version: str) -> list[str]:
    meta = os.path.join(sglang_contract_env.root(), version, f"sglang-{version}.dist-info", "METADATA")
    with open(meta) as f:
        return [line.split(":", 1)[1].strip() for line in f if line.startswith("Requires-Dist:")]


def mismatches(pins: dict[str, str]) -> list[str]:
    ours = our_requirements()
    return [f"{name}: SGLang pins {v}, setup.py asks {ours[name]}" for name, v in pins.items()
            if name in ours and not ours[name].specifier.contains(v, prereleases=True)]


@pytest.mark.parametrize("version", versions.CONTRACT_VERSIONS)
def test_our_requirements_hold_each_supported_sglangs_pins(version):
    if not sglang_contract_env.is_installed(version):
        pytest.skip(f"SGLang {version} is not in the contract env: python tools/sglang_contract_env.py install")
    pins = sglang_pins(contract_requires(version))
    assert "transformers" in pins and "torch" in pins  # what SGLang pins, read from its own metadata
    assert not mismatches(pins)


def test_the_installed_sglangs_pins_hold_too():
    import importlib.metadata

    try:
        requires = importlib.metadata.requires("sglang") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SGLang is not installed here (the contract env's copies are checked above)")
    assert not mismatches(sglang_pins(requires))


def test_a_pin_outside_our_range_is_caught():
    assert mismatches({"transformers": "5.11.0"}) == [
        f"transformers: SGLang pins 5.11.0, setup.py asks {Requirement(versions.TRANSFORMERS_REQUIREMENT)}"]
    assert mismatches({"transformers": "5.12.1", "torch": "2.11.0", "tokenizers": "0.22.2", "not-ours": "1"}) == []
