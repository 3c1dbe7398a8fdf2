"""Upstream's defaults, as a slime user's command line resolves here."""

from __future__ import annotations

import json
import os
import re

import pytest

from slime.arguments import ArgumentError, build_parser, parse_args
from slime.upstream_flags import DEFAULTS_DIFFER, MODEL_SHAPE_FLAGS, REFUSED
from test_dry_run import APRIL_PARTIAL, UPSTREAM_RUN_QWEN3_4B
from test_megatron_args import QWEN3, qwen3_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Same:
    """Upstream's default is another flag's value."""

    def __init__(self, name: str):
        self.name = name


UPSTREAM_DEFAULTS = {
    # upstream's effective values on GPUs (a dry run resolves a command line as on GPUs)
    "--bf16": True, "--use-distributed-optimizer": True, "--accumulate-allreduce-grads-in-fp32": True,
    "--offload": Same("colocate"),
    # slime's own flags
    "--actor-num-nodes": 1, "--advantage-estimator": "grpo", "--apply-chat-template": False,
    "--buffer-filter-path": None, "--calculate-per-token-loss": False, "--colocate": False,
    "--custom-generate-function-path": None, "--custom-rm-path": None, "--debug-rollout-only": False,
    "--debug-train-only": False, "--disable-grpo-std-normalization": False, "--dynamic-sampling-filter-path": None,
    "--entropy-coef": 0.0, "--eps-clip": 0.2, "--eps-clip-c": None, "--eps-clip-high": Same("eps_clip"),
    "--eval-interval": None, "--eval-max-response-len": Same("rollout_max_response_len"), "--eval-prompt-data": None,
    "--eval-temperature": Same("rollout_temperature"), "--eval-top-p": Same("rollout_top_p"), "--gamma": 1.0,
    "--group-rm": False, "--kl-coef": 0.0, "--kl-loss-coef": 0.0, "--kl-loss-type": "k1", "--label-key": None,
    "--load": None, "--load-debug-rollout-data": None, "--loss-type": "policy_loss", "--lr": 1e-6,
    "--max-tokens-per-gpu": None, "--metadata-key": "metadata", "--micro-batch-size": 1, "--n-samples-per-eval-prompt": 1,
    "--n-samples-per-prompt": 1, "--normalize-advantages": False, "--num-epoch": None,
    "--over-sampling-batch-size": Same("rollout_batch_size"), "--partial-rollout": False, "--ref-load": None,
    "--reward-key": None, "--rm-url": None, "--rollout-function-path": "slime.rollout.sglang_rollout.generate_rollout",
    "--rollout-health-check-first-wait": 0, "--rollout-health-check-timeout": 30.0, "--rollout-max-prompt-len": None,
    "--rollout-max-context-len": None, "--eval-max-context-len": Same("rollout_max_context_len"),
    "--rollout-num-gpus-per-engine": 1, "--rollout-seed": 42, "--rollout-shuffle": False, "--rollout-stop": None,
    "--rollout-stop-token-ids": None, "--rollout-temperature": 1.0, "--rollout-top-k": -1, "--rollout-top-p": 1.0,
    "--save": None, "--save-debug-rollout-data": None, "--save-interval": None, "--seed": 1234, "--clip-grad": 1.0,
    "--tis-clip": 2.0, "--tis-clip-low": 0.0, "--update-weight-buffer-size": 512 * 1024**2,
    "--update-weights-interval": 1, "--use-dynamic-batch-size": False, "--use-fault-tolerance": False,
    "--use-kl-loss": False, "--use-tis": False, "--wandb-group": None,
    # slime's SGLang and sglang-router flags
    "--sglang-router-ip": None, "--sglang-router-port": None, "--sglang-server-concurrency": 512,
    "--router-log-level": "warn",
    # Megatron-LM's
    "--adam-beta1": 0.9, "--attention-softmax-in-fp32": False, "--context-parallel-size": 1,
    "--expert-model-parallel-size": 1, "--expert-tensor-parallel-size": None, "--min-lr": 0.0, "--optimizer": "adam",
    "--pipeline-model-parallel-size": 1, "--recompute-granularity": None, "--recompute-method": None,
    "--recompute-num-layers": None, "--rotary-percent": 1.0, "--sequence-parallel": False,
    "--tensor-model-parallel-size": 1, "--use-rope-scaling": False,
}
MINIMAL = ["--hf-checkpoint", "/models/Qwen3-4B", "--prompt-data", "/data/dapo.jsonl", "--rm-type", "deepscaler",
           "--rollout-batch-size", "32", "--num-rollout", "10"]


def doc_section(title: str) -> str:
    doc = open(os.path.join(REPO, "docs", "upstream-flags.md")).read()
    return doc.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def dest(flag: str) -> str:
    return build_parser()._option_string_actions[flag].dest


def expected(a, flag: str):
    want = UPSTREAM_DEFAULTS[flag]
    return vars(a)[want.name] if isinstance(want, Same) else want


@pytest.mark.parametrize("argv", [MINIMAL, MINIMAL + ["--colocate", "--actor-num-gpus-per-node", "8"],
                                  UPSTREAM_RUN_QWEN3_4B, APRIL_PARTIAL],
                         ids=["minimal", "minimal-colocated", "upstream-run-qwen3-4B", "april-partial"])
def test_what_a_command_line_leaves_out_resolves_to_upstreams_default(argv):
    a = parse_args(argv + ["--dry-run"])  # as on the GPU machines (this box has neither the paths nor a GPU)
    given = {t.split("=", 1)[0] for t in argv if t.startswith("--")}
    wrong = {f: (vars(a)[dest(f)], expected(a, f)) for f in UPSTREAM_DEFAULTS
             if f not in given and vars(a)[dest(f)] != expected(a, f)}
    assert not wrong, f"resolved here vs upstream's default: {wrong}"


def test_upstreams_scripts_get_bf16_the_distributed_optimizer_and_offload_without_asking():
    for argv in (UPSTREAM_RUN_QWEN3_4B, APRIL_PARTIAL):
        assert not {"--bf16", "--use-distributed-optimizer", "--offload", "--offload-train"} & set(argv)
        a = parse_args(argv + ["--dry-run"])
        assert (a.train_backend, a.bf16, a.use_distributed_optimizer, a.offload) == ("megatron", True, True, True)
        off = parse_args(argv + ["--dry-run", "--no-bf16", "--no-use-distributed-optimizer", "--no-offload"])
        assert (off.bf16, off.use_distributed_optimizer, off.offload) == (False, False, False)


def test_defaults_on_this_cpu_box(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(qwen3_config(*QWEN3["qwen3-0.6B"])))
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    base = ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math",
            "--rollout-batch-size", "2", "--num-rollout", "1"]
    fsdp = parse_args(base)  # auto: FSDP on a CPU box, fp32 (bf16 is the GPU default)
    assert (fsdp.train_backend, fsdp.bf16, fsdp.use_distributed_optimizer, fsdp.offload) == ("fsdp", False, False, False)
    assert parse_args(base + ["--bf16"]).bf16 is True
    meg = parse_args(base + ["--train-backend", "megatron", "--colocate"])
    assert (meg.bf16, meg.use_distributed_optimizer, meg.offload, meg.accumulate_allreduce_grads_in_fp32) == (
        False, True, True, False)
    assert parse_args(base + ["--colocate", "--no-offload-train"]).offload is False  # upstream's name for it
    for flags, error in [(["--offload"], "--offload: needs --colocate"),
                         (["--colocate", "--offload", "--no-offload-train"], "--offload-train: contradicts --offload"),
                         (["--train-backend", "fsdp", "--use-distributed-optimizer"],
                          "--use-distributed-optimizer: is supported by --train-backend megatron only")]:
        with pytest.raises(ArgumentError, match=re.escape(error)):
            parse_args(base + flags)


@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--prompt-data", "--rm-type", "--rollout-batch-size",
                                  "--num-rollout"])
def test_what_upstream_requires_is_required(flag):
    i = MINIMAL.index(flag)
    with pytest.raises(ArgumentError, match=re.escape(flag)):
        parse_args(MINIMAL[:i] + MINIMAL[i + 2:] + ["--dry-run"])


def test_the_docs_list_each_default_once_with_upstreams_value_and_ours():
    as_upstream = set(re.findall(r"`(--[a-z0-9-]+)`", doc_section("As upstream").strip().split("\n\n")[-1]))
    assert as_upstream == set(UPSTREAM_DEFAULTS), (sorted(as_upstream - set(UPSTREAM_DEFAULTS)),
                                                   sorted(set(UPSTREAM_DEFAULTS) - as_upstream))
    differ = doc_section("Defaults that differ")
    for flag, (upstream, here) in DEFAULTS_DIFFER.items():  # the model-shape flags: one table, `here` said once
        row = f"| `{flag}` | {upstream} |" if flag in MODEL_SHAPE_FLAGS else f"| `{flag}` | {upstream} | {here} |"
        assert re.search(f"^{re.escape(row)}$", differ, re.M), flag
    assert "model-shape flags are optional here: the model is built from --hf-checkpoint's config.json; a flag given " \
        "must agree with it" in " ".join(differ.split())
    assert not set(DEFAULTS_DIFFER) & set(UPSTREAM_DEFAULTS)
    rows = re.findall(r"^\| ((?:`--[a-z0-9-]+`(?:, )?)+) \|", doc_section("Refused, with what to use instead"), re.M)
    refused = [f for cell in rows for f in re.findall(r"`(--[a-z0-9-]+)`", cell)]
    assert sorted(refused) == sorted(REFUSED)  # no row for a flag that is taken now
