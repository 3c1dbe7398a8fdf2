"""The embedded engine's pause, update and flush semantics against SGLang's own scheduler code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from slime.backends.hf_engine import pause
from slime.backends.hf_engine.protocol import build_response
from slime.backends.hf_engine.sampling import SamplingParams
from slime.backends.hf_engine.scheduler import Request, Scheduler
from slime.utils import sglang_versions as versions
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import sglang_contract_env  # noqa: E402

pytestmark = pytest.mark.sglang_contract
WORDS = [str(i) for i in range(10)] + list("abcdefghijklmnopqrstuvwxyz")

SCENARIO = [
    # in_place: the row is held with its KV; an update's flush fails while it is held, without a flush it succeeds
    ["queue", "a"], ["decode", 3], ["pause", "in_place"], ["update", "11", True], ["update", "11", False], ["flush"],
    ["decode", 2], ["continue"], ["decode", 2], ["finish", "a"],
    # retract: the running request goes back to the queue; paused, the queue does not stop a flush
    ["queue", "b"], ["decode", 2], ["queue", "c"], ["pause", "retract"], ["update", "12", True], ["decode", 1],
    ["continue"], ["decode", 2], ["finish", "b"], ["finish", "c"],
    # in_place with a waiting request (0 tokens across the update) and an idle engine's flush
    ["queue", "d"], ["decode", 1], ["queue", "e"], ["pause", "in_place"], ["flush"], ["update", "13", False],
    ["continue"], ["decode", 1], ["finish", "d"], ["finish", "e"],
    ["pause", "in_place"], ["flush"], ["queue", "f"], ["update", "14", True], ["finish", "f"], ["continue"],
]


def sglang_observations(version: str) -> list[dict]:
    cmd = [sys.executable, os.path.join(REPO, "tests", "sglang_scheduler_semantics.py")]
    for d in sglang_contract_env.site_dirs(version):
        cmd += ["--site", d]
    p = subprocess.run(cmd, input=json.dumps(SCENARIO), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def our_observations(model_dir) -> list[dict]:
    """The scenario on our scheduler, stepped by hand as its loop steps it (nothing runs while it is paused)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    s = Scheduler(model, tok, max_running=8, max_total_tokens=4096, max_prefill_tokens=4096, seed=0,
                  chunked_prefill_size=512, block_size=8, weight_version="10")
    reqs: dict[str, Request] = {}
    out = []
    for op in SCENARIO:
        kind, result = op[0], None
        if kind == "queue":
            reqs[op[1]] = Request(op[1], [1, 5, 6], SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True))
            s._add(reqs[op[1]])
        elif kind == "decode":
            for _ in range(op[1]):
                if s.paused:
                    break
                s._admit()
                s._step()
        elif kind == "pause":
            pause.pause(s, op[1])
        elif kind == "continue":
            pause.resume(s)
        elif kind == "update":
            result = pause.update(s, lambda: None, op[1], op[2])[2]
        elif kind == "flush":
            result = pause.flush_if_idle(s)
        elif kind == "finish":
            r = reqs.pop(op[1])
            meta = build_response(r, tok, False, s.weight_version, True)["meta_info"]
            result = {"weight_version": meta["weight_version"], "weight_versions": meta["weight_versions"],
                      "tokens": len(r.output_ids)}
            s.abort(op[1])
        out.append({"op": op, "result": result, "paused": s.paused, "running": sorted(r.rid for r in s.running),
                    "waiting": sorted(r.rid for r in s.waiting),
                    "tokens": {rid: len(r.output_ids) for rid, r in sorted(reqs.items())}})
    return out


def require(version: str) -> None:
    if not sglang_contract_env.is_installed(version):
        msg = f"SGLang {version} not installed for the contract tests: run `python tools/sglang_contract_env.py install`"
        if os.environ.get("SLIME_REQUIRE_SGLANG_CONTRACT") == "1":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="module")
def theirs():
    require(versions.SGLANG_PINNED)
    return sglang_observations(versions.SGLANG_PINNED)


def test_pause_update_and_flush_match_sglangs_scheduler(tmp_path, theirs):
    version = versions.SGLANG_PINNED
    torch.set_num_threads(1)
    build_tiny_qwen3(str(tmp_path), build_tokenizer(WORDS), TinyQwen3Spec(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        max_position_embeddings=256), seed=0)
    ours = our_observations(tmp_path)
    for t, o in zip(theirs, ours):
        assert o == t, f"after {t['op']}: SGLang {version} {t}, ours {o}"
    assert len(theirs) == len(ours) == len(SCENARIO)
    # the scenario exercises what it claims: a refused and an accepted flush, spans across updates
    results = [t["result"] for t in theirs]
    assert False in results and True in results
    assert any(isinstance(r, dict) and len(r["weight_versions"]) == 2 for r in results)


def test_our_client_reads_sglangs_spans_and_copes_without_them(theirs):
    """The replies SGLang's own span code built in the scenario, read by our client token by token."""
    from slime.rollout.engine_versions import VersionLabels
    from slime.rollout.sampling_request import token_versions
    from slime.utils.types import Sample

    finished = [t["result"] for t in theirs if t["op"][0] == "finish"]
    assert any(len(r["weight_versions"]) == 2 for r in finished)
    for r in finished:
        meta = {"weight_version": r["weight_version"], "weight_versions": r["weight_versions"]}
        got = token_versions(meta, r["tokens"], "sglang")
        want = [int(sp["version"]) for sp in r["weight_versions"] for _ in range(sp["start"], sp["end"])]
        assert got == want
        versions_seen = [int(sp["version"]) for sp in r["weight_versions"]]
        s = Sample(index=0, group_index=0)
        assert VersionLabels("sglang").label_tokens(s, got, True, min(versions_seen), max(versions_seen), "r") == want
        assert not s.metadata
    require(versions.SGLANG_OLDEST)
    site = sglang_contract_env.site_dirs(versions.SGLANG_OLDEST)[0]
    assert not os.path.exists(os.path.join(site, "sglang", "srt", "utils", "weight_versions.py"))
    with open(os.path.join(site, "sglang", "srt", "managers", "tokenizer_manager.py")) as f:
        assert "weight_versions" not in f.read()
