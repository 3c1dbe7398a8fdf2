"""Flags passed through to SGLang and sglang-router, checked at parse time against the real parts' own flags."""

from __future__ import annotations

import json
import re

import pytest

from slime.arguments import ArgumentError, parse_args
from slime.utils import sglang_flags
from slime.utils.sglang_server_flags import FLAGS
from slime.utils.sglang_versions import CONTRACT_VERSIONS, SGLANG_OLDEST, SGLANG_PINNED


@pytest.fixture
def base(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "1+1", "label": "2"}) + "\n")
    return ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math",
            "--rollout-batch-size", "2", "--num-rollout", "1"]


def refused(argv, match: str) -> str:
    with pytest.raises(ArgumentError, match=re.escape(match)) as e:
        parse_args(argv)
    return str(e.value)


def test_sglang_flags_are_checked_against_sglangs_own(base):
    a = parse_args(base + ["--sglang-mem-fraction-static", "0.7", "--sglang-enable-memory-saver",
                           "--sglang-cuda-graph-bs-decode", "1", "2", "4", "--sglang-context-length=4096"])
    assert a.sglang_extra_args == {"mem-fraction-static": "0.7", "enable-memory-saver": True,
                                   "cuda-graph-bs-decode": ["1", "2", "4"], "context-length": "4096"}
    msg = refused(base + ["--sglang-mem-fraction-statc", "0.7"], "--sglang-mem-fraction-statc: ")
    assert "has no server flag --mem-fraction-statc; did you mean --sglang-mem-fraction-static?" in msg
    assert f"SGLang {SGLANG_PINNED}" in msg  # which SGLang said so (not installed here: the shipped list)
    refused(base + ["--sglang-router-polcy", "x"], "did you mean --sglang-router-policy?")  # our own --sglang-* too
    refused(base + ["--sglang-no-such-thing-at-all"], "see `python -m sglang.launch_server --help`")
    # the embedded engine, named: the SGLang flags it has, and its own
    assert parse_args(base + ["--rollout-backend", "embedded", "--sglang-kv-blocks", "64"]).sglang_extra_args == {
        "kv-blocks": "64"}
    refused(base + ["--rollout-backend", "embedded", "--sglang-enable-dp-attention"],
            "--sglang-enable-dp-attention: the embedded engine (--rollout-backend embedded) has no server flag")
    refused(base + ["--rollout-batch-sise", "2"], "unrecognized argument: --rollout-batch-sise (did you mean "
                                                 "--rollout-batch-size?)")


def test_the_installed_sglang_versions_flags_are_used(base, monkeypatch):
    only_new = sorted(FLAGS[SGLANG_PINNED] - FLAGS[SGLANG_OLDEST])[0]
    assert parse_args(base + [f"--sglang-{only_new}", "1"]).sglang_extra_args == {only_new: "1"}
    sglang_flags.server_flags.cache_clear()
    monkeypatch.setattr(sglang_flags, "installed_sglang_version", lambda: SGLANG_OLDEST)
    try:
        refused(base + [f"--sglang-{only_new}", "1"], f"the installed SGLang {SGLANG_OLDEST} has no server flag")
    finally:
        sglang_flags.server_flags.cache_clear()


@pytest.mark.sglang_contract
@pytest.mark.parametrize("version", CONTRACT_VERSIONS)
def test_the_shipped_flag_lists_are_sglangs_own(version):
    """Each shipped list equals what that version's own ServerArgs.add_cli_args registers."""
    import sys

    sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", "tools"))
    import sglang_contract_env
    import sglang_server_flags

    if not sglang_contract_env.is_installed(version):
        pytest.skip(f"SGLang {version} is not in the contract env: python tools/sglang_contract_env.py install")
    assert set(sglang_server_flags.contract_flags(version)) == FLAGS[version]


def test_router_flags_reach_sglang_router(base, tmp_path):
    from slime.backends.sglang_utils.router import build_router_command

    a = parse_args(base + ["--router-policy", "cache_aware", "--router-balance-abs-threshold", "10",
                           "--router-balance-rel-threshold", "1.2", "--router-request-id-headers", "x-a", "x-b"])
    assert a.sglang_router_policy == "cache_aware"  # upstream's name for this project's --sglang-router-policy
    assert a.router_extra_args == ("--balance-abs-threshold", "10", "--balance-rel-threshold", "1.2",
                                   "--request-id-headers", "x-a", "x-b")
    cmd = build_router_command(a, "127.0.0.1", 1, 2)
    assert cmd[cmd.index("--policy") + 1] == "cache_aware" and cmd[-7:] == list(a.router_extra_args)
    refused(base + ["--router-balance-abs-treshold", "10"], "did you mean --router-balance-abs-threshold?")
    refused(base + ["--router-balance-abs-threshold", "ten"], "sglang-router's flags: argument "
                                                             "--router-balance-abs-threshold: invalid int value")
    refused(base + ["--router-pd-disaggregation"], "prefill/decode disaggregation is not supported")
    refused(base + ["--router-prometheus-port", "9"], "the run picks a free port")
    refused(base + ["--router-request-timeout-secs", "9"], "use --sglang-router-request-timeout-secs")


def test_upstream_flags_that_mean_something_else_here(base):
    refused(base + ["--sglang-config", "deploy.yaml"], "--sglang-config: upstream slime's flag is not taken here: "
                                                       "upstream's engine-deployment YAML")
    refused(base + ["--prefill-num-servers", "2"], "prefill/decode disaggregation is not supported")
    msg = refused(base + ["--loss-type", "custom_loss"], "--loss-type custom_loss: is not supported")
    assert "use --loss-type policy_loss" in msg and "--custom-rm-path" in msg
    refused(base + ["--custom-loss-function-path", "m.f"], "use --loss-type policy_loss")


def test_update_weights_interval_on_both_entry_points(base):
    assert parse_args(base + ["--update-weights-interval", "1"]).update_weights_interval == 1  # upstream's default
    refused(base + ["--update-weights-interval", "2"], "--update-weights-interval: 2 is train_async.py's")
    a = parse_args(base + ["--update-weights-interval", "2", "--max-async-lag", "2"], entry="train_async.py")
    assert a.update_weights_interval == 2
    refused(base + ["--update-weights-interval", "0"], "--update-weights-interval: must be >= 1")
