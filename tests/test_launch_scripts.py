"""The GPU launch scripts (scripts/partial_rollout/common.sh and its experiment files), parsed and validated.

APRIL's setting is checked flag by flag against the APRIL repository's script; each variant differs where it says."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from test_megatron_args import QWEN3, qwen3_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "scripts/partial_rollout/*/*/run-*.sh")))
# DeepSeek-R1-Distill-Qwen-1.5B's published config (a Qwen2 model)
R1_DISTILL_1_5B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936,
                   "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                   "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000,
                   "tie_word_embeddings": False, "max_position_embeddings": 131072, "use_sliding_window": False}
CONFIGS = {"qwen3-4B": qwen3_config(*QWEN3["qwen3-4B"]), "qwen3-8B": qwen3_config(*QWEN3["qwen3-8B"]),
           "deepseek-r1-distill-qwen-1.5B": R1_DISTILL_1_5B}
FIELDS = ("colocate", "offload", "update_weight_mode", "rollout_backend", "train_backend", "actor_num_gpus_per_node",
          "num_engines", "rollout_num_gpus_per_engine", "hf_checkpoint", "input_key", "label_key", "rm_type",
          "rollout_batch_size", "n_samples_per_prompt", "over_sampling_batch_size", "partial_rollout",
          "rollout_max_response_len", "rollout_temperature", "global_batch_size", "advantage_estimator", "eps_clip",
          "eps_clip_high", "lr", "weight_decay", "adam_beta1", "adam_beta2", "eval_interval", "eval_datasets",
          "n_samples_per_eval_prompt", "eval_top_p", "dynamic_sampling_filter_path", "tensor_model_parallel_size",
          "bf16", "use_tis", "wandb_mode", "wandb_group", "save", "load", "num_layers", "hidden_size")


def script_model(script: str) -> str:
    for line in open(os.path.join(REPO, script)):
        if line.startswith("MODEL="):
            return line.strip().split("=", 1)[1]
    raise AssertionError(f"{script} sets no MODEL")


def run_script(script: str, tmp_path, *argv: str, fields=FIELDS, **env_extra) -> dict:
    """The parsed flags of `script`'s train.py command line (python shimmed to parse_args and print them)."""
    shim = tmp_path / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "python3").write_text(
        "#!/usr/bin/env bash\nshift\n"  # drop train.py
        f"exec {sys.executable} -c \"import json, sys; from slime.arguments import parse_args; "
        f"a = parse_args(sys.argv[1:]); print(json.dumps({{k: vars(a)[k] for k in {list(fields)!r}}}))\" \"$@\"\n")
    (shim / "python3").chmod(0o755)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(CONFIGS[script_model(script)]))
    data = tmp_path / "dapo.jsonl"
    data.write_text('{"prompt": "1+1?", "label": "2"}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update({"PATH": f"{shim}:{os.environ['PATH']}", "MODEL_DIR": str(model), "DATA": str(data),
                "EVAL": str(data), "SAVE": str(tmp_path / "ckpt"), "PYTHONPATH": REPO, "PYTHON": str(shim / "python3"),
                **env_extra})
    out = subprocess.run(["bash", os.path.join(REPO, script), *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


PAPER = {  # the APRIL repository's Qwen3-4B setting, colocated on 8 GPUs
    "colocate": True, "offload": True, "update_weight_mode": "tensor", "rollout_backend": "sglang",
    "train_backend": "megatron", "actor_num_gpus_per_node": 8, "num_engines": 4, "rollout_num_gpus_per_engine": 2,
    "input_key": "prompt", "label_key": "label", "rm_type": "deepscaler", "rollout_batch_size": 32,
    "n_samples_per_prompt": 8, "over_sampling_batch_size": 64, "partial_rollout": True,
    "rollout_max_response_len": 16384, "rollout_temperature": 0.8, "global_batch_size": 256,
    "advantage_estimator": "grpo", "eps_clip": 0.2, "eps_clip_high": 0.28, "lr": 1e-6, "weight_decay": 0.1,
    "adam_beta1": 0.9, "adam_beta2": 0.98, "eval_interval": 10, "n_samples_per_eval_prompt": 16, "eval_top_p": 0.7,
    "dynamic_sampling_filter_path": None, "tensor_model_parallel_size": 2, "bf16": True, "use_tis": True,
    "wandb_mode": "offline",
}
VARIANTS = {  # what each experiment changes
    "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh": {},
    "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-baseline.sh": {"partial_rollout": False,
                                                                       "over_sampling_batch_size": 32},
    "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial-dynamic-sampling.sh": {
        "dynamic_sampling_filter_path": "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"},
    "scripts/partial_rollout/qwen/gspo/run-qwen3-4B-dapo-partial-gspo.sh": {
        "advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4},
    "scripts/partial_rollout/qwen/grpo/run-qwen3-8B-dapo-partial.sh": {"hidden_size": 4096},
    "scripts/partial_rollout/deepseek/grpo/run-deepseek-r1-distill-qwen-1.5B-dapo-partial.sh": {
        "num_layers": 28, "hidden_size": 1536},
}


def test_every_experiment_is_listed():
    assert SCRIPTS == sorted(VARIANTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_command_line_validates(script, tmp_path):
    a = run_script(script, tmp_path, "--dry-run")  # resolved as on the GPUs (bf16 is their default)
    want = {**PAPER, **VARIANTS[script]}
    assert {k: a[k] for k in want} == want
    assert a["eval_datasets"] == [["aime", str(tmp_path / "dapo.jsonl")]]
    assert a["hf_checkpoint"] == str(tmp_path / "model") and a["save"] == a["load"] == str(tmp_path / "ckpt")
    assert a["wandb_group"] == os.path.basename(script)[len("run-"):-len(".sh")]


# what common.sh says it does differently from the APRIL repository's script (and what only names a place)
NAMED_DIFFERENCES = {"use_tis", "save_interval", "use_kl_loss", "kl_loss_type", "ref_load", "wandb_project",
                     "wandb_group", "wandb_key", "wandb_mode", "rollout_backend", "hf_checkpoint", "prompt_data",
                     "eval_prompt_data", "eval_datasets", "load", "save", "run_dir", "no_gradient_accumulation_fusion",
                     "expert_tensor_parallel_size"}


def test_the_april_script_and_ours_differ_only_where_common_sh_says(tmp_path):
    from slime.arguments import parse_args
    from test_upstream_compat import APRIL_SCRIPT

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(CONFIGS["qwen3-4B"]))
    (tmp_path / "dapo.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    april = vars(parse_args(APRIL_SCRIPT.format(model=model, ckpt=tmp_path / "ckpt", data=tmp_path / "dapo.jsonl",
                                                key="k" * 40).split() + ["--dry-run"]))
    fields = sorted(k for k in april if k not in ("_frozen", "run_dir", "given_flags"))  # values, not the command line
    ours = run_script("scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh", tmp_path, "--dry-run",
                      fields=fields)
    differ = {k for k in fields if ours[k] != (list(april[k]) if isinstance(april[k], tuple) else april[k])}
    assert differ <= NAMED_DIFFERENCES, {k: (april[k], ours[k]) for k in differ - NAMED_DIFFERENCES}
    text = open(os.path.join(REPO, "scripts/partial_rollout/common.sh")).read()
    for named in ("--use-tis", "--save-interval 20", "no --use-kl-loss", "no --ref-load", "W&B names",
                  "--no-gradient-accumulation-fusion", "parallel sizes of 1"):
        assert named in text


def test_wandb_goes_online_only_with_a_key_from_the_environment(tmp_path):
    script = "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh"
    assert run_script(script, tmp_path, WANDB_API_KEY="k" * 40)["wandb_mode"] == "online"
    for path in SCRIPTS + ["scripts/partial_rollout/common.sh"]:
        text = open(os.path.join(REPO, path)).read()
        assert "pkill" not in text and "/root/" not in text  # no process sweeps, no machine paths
        assert "WANDB_API_KEY=" not in text  # the key is never written, only read from the environment


def test_missing_paths_are_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_DIR", "DATA", "EVAL")}
    out = subprocess.run(["bash", os.path.join(REPO, "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "MODEL_DIR" in out.stderr


def test_fsdp_backend_gets_no_megatron_flags(tmp_path):
    a = run_script("scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh", tmp_path, TRAIN_BACKEND="fsdp",
                   ROLLOUT_TP="1")
    assert (a["train_backend"], a["tensor_model_parallel_size"], a["num_engines"]) == ("fsdp", 1, 8)
    # bf16 where the trainer runs on GPUs, FSDP too (a dry run resolves the command line as on them)
    assert run_script("scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh", tmp_path, "--dry-run",
                      TRAIN_BACKEND="fsdp")["bf16"] is True


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.rocm"])
def test_dockerfiles_pin_what_setup_py_allows_and_hold_no_secrets(dockerfile):
    import re

    text = open(os.path.join(REPO, dockerfile)).read()
    setup = open(os.path.join(REPO, "setup.py")).read()
    pins = dict(re.findall(r"ARG (\w+_VERSION)=(\S+)", text))
    assert {"SGLANG_VERSION", "SGLANG_ROUTER_VERSION", "MEGATRON_CORE_VERSION", "RAY_VERSION"} <= set(pins)
    assert f'"sglang-router=={pins["SGLANG_ROUTER_VERSION"]}"' in setup
    major, minor, _ = (int(x) for x in pins["MEGATRON_CORE_VERSION"].split("."))
    assert '"megatron-core>=0.16.1,<0.17"' in setup and (major, minor) == (0, 16)
    from slime.utils import sglang_versions as versions  # setup.py's sglang extra is versions.sglang_requirement()

    assert pins["SGLANG_VERSION"] == versions.SGLANG_PINNED and '_versions["sglang_requirement"]()' in setup
    assert "docker build -f " + dockerfile in text and "docker run" in text  # how to build and run
    assert "-e WANDB_API_KEY \\" in text and not re.search(r"(API_KEY|TOKEN|PASSWORD)\s*=", text)
    assert re.search(r"pip install .*-e \"\.\[test\]\"", text)  # our package
