"""`train.py ... --dry-run` (and train_async.py's)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from slime.arguments import parse_args
from slime.dry_run import dry_run
from test_megatron_args import QWEN3, qwen3_config
from test_upstream_compat import APRIL_SCRIPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# upstream's scripts/run-qwen3-4B.sh: its train.py argv (MODEL_ARGS, CKPT_ARGS, ROLLOUT_ARGS, OPTIMIZER_ARGS,
# GRPO_ARGS, WANDB_ARGS (all commented out), PERF_ARGS, EVAL_ARGS, SGLANG_ARGS, MISC_ARGS) for NUM_GPUS=8
UPSTREAM_RUN_QWEN3_4B = """
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 1000000 --vocab-size 151936 --kv-channels 128 --qk-layernorm
--hf-checkpoint /root/Qwen3-4B --ref-load /root/Qwen3-4B_torch_dist --load /root/Qwen3-4B_slime/
--save /root/Qwen3-4B_slime/ --save-interval 20
--prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--eval-interval 20 --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl --n-samples-per-eval-prompt 16
--eval-max-response-len 16384 --eval-top-p 1
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.7
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash
""".split()
APRIL_PARTIAL = APRIL_SCRIPT.format(model="/root/Qwen3-4B", ckpt="/root/Qwen3-4B_slime", key="k" * 40,
                                    data="/root/dapo-math-17k/dapo-math-17k.jsonl").split()


def dry(entry: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python <entry> argv --dry-run`, and whether Ray was started in that process (it must not be)."""
    code = (f"import sys, ray; sys.argv = [{entry!r}]; import runpy; "
            f"rc = runpy.run_path({os.path.join(REPO, entry)!r}, run_name='dry')['main']({argv!r}); "
            "print('ray started' if ray.is_initialized() else 'ray not started'); sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])})


def peak_gb(stdout: str) -> float:
    return float(re.search(r"peak ([\d.]+) GB of", stdout).group(1))


@pytest.mark.parametrize("argv", [UPSTREAM_RUN_QWEN3_4B, APRIL_PARTIAL], ids=["upstream-run-qwen3-4B", "april-partial"])
def test_upstream_command_lines_dry_run_on_cpu(argv):
    out = dry("train.py", argv + ["--dry-run"])
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "ray not started" in text and "error:" not in text
    # upstream's effective settings, without any opt-in flag: bf16, the distributed optimizer, offload (colocated)
    assert ("trainer megatron: bf16 weights and compute, fp32 main weights and Adam state, gradients reduced in fp32; "
            "optimizer state sharded over 4 data-parallel rank(s) (distributed optimizer); trainer offloaded to host "
            "memory while the engines generate") in text
    assert "not on this machine (checked again when the run starts): --hf-checkpoint /root/Qwen3-4B" in text
    assert "node 0 GPU 7: trainer rank 7 (TP 1, DP 3) + engine 3 (TP 1 of 2)" in text
    assert "--tp-size 2" in text and "--enable-memory-saver" in text  # the SGLang command the launcher builds
    assert peak_gb(text) < 80 and "fits" in text


def test_train_async_dry_runs_a_disaggregated_command_line(tmp_path):
    argv = [a for a in UPSTREAM_RUN_QWEN3_4B if a != "--colocate"] + [
        "--rollout-num-gpus", "8", "--actor-num-nodes", "1", "--update-weights-interval", "2", "--max-async-lag", "2"]
    out = dry("train_async.py", argv + ["--dry-run", "h200"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "trainer on its own devices (not colocated)" in out.stdout and "for H200 GPUs" in out.stdout
    assert "rollout GPU 7: engine 3 (TP 1 of 2)" in out.stdout and "training (trainer GPUs)" in out.stdout
    bad = dry("train.py", argv[:-2] + ["--dry-run"])  # the interval is train_async.py's: refused on train.py, saying why
    assert bad.returncode == 2 and "--update-weights-interval: 2 is train_async.py's" in bad.stderr


@pytest.fixture
def qwen3_4b(tmp_path):
    (tmp_path / "Qwen3-4B").mkdir()
    (tmp_path / "Qwen3-4B" / "config.json").write_text(json.dumps(qwen3_config(*QWEN3["qwen3-4B"])))
    (tmp_path / "dapo.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    return tmp_path


def local_argv(d) -> list[str]:
    swap = {"/root/Qwen3-4B": str(d / "Qwen3-4B"), "/root/dapo-math-17k/dapo-math-17k.jsonl": str(d / "dapo.jsonl"),
            "/root/aime-2024/aime-2024.jsonl": str(d / "dapo.jsonl")}
    return [swap.get(a, a) for a in UPSTREAM_RUN_QWEN3_4B]


def test_the_model_config_is_checked_when_it_is_here(qwen3_4b, capsys):
    a = parse_args(local_argv(qwen3_4b) + ["--dry-run"])
    assert dry_run("train.py", a) == 0
    text = capsys.readouterr().out
    assert "config.json (qwen3); the model-shape flags agree with it" in text
    assert "not on this machine (checked again when the run starts): --ref-load /root/Qwen3-4B_torch_dist" in text
    out = dry("train.py", local_argv(qwen3_4b) + ["--num-layers", "35", "--dry-run"])
    assert out.returncode == 2 and "--num-layers 35 but " in out.stderr and "config.json says 36" in out.stderr


def test_what_does_not_fit_is_named(qwen3_4b, capsys):
    # the three opt-outs: fp32, every rank holding all Adam state, the trainer resident next to the engines
    a = parse_args(local_argv(qwen3_4b) + ["--no-bf16", "--no-use-distributed-optimizer", "--no-offload", "--dry-run"])
    assert (a.bf16, a.use_distributed_optimizer, a.offload) == (False, False, False)
    assert dry_run("train.py", a) == 0  # an estimate warns; it does not refuse
    text = capsys.readouterr().out
    assert "trainer megatron: fp32 weights, compute and Adam state;" in text and "trainer stays on the devices while the engines generate (--no-offload)" in text
    assert peak_gb(text) > 80 and "DOES NOT FIT" in text and "WARNING: the fullest GPU would need more" in text
    assert dry_run("train.py", parse_args(local_argv(qwen3_4b) + ["--dry-run", "h200"])) == 0
    assert "for H200 GPUs" in capsys.readouterr().out


def defaults_block(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("defaults that differ from upstream slime's"))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("  "))
    return lines[start + 1 : end]


def test_the_defaults_that_differ_from_upstreams_are_listed_unless_given(qwen3_4b, capsys):
    from slime.dry_run import upstream_defaults_left
    from slime.upstream_flags import DEFAULTS_DIFFER, MODEL_SHAPE_FLAGS

    a = parse_args(local_argv(qwen3_4b) + ["--dry-run"])
    assert dry_run("train.py", a) == 0
    block = defaults_block(capsys.readouterr().out)
    assert ("  --router-policy round_robin (its other name here: --sglang-router-policy) (upstream: cache_aware "
            "(sglang-router's))") in block
    assert "  --train-backend megatron (upstream: megatron (the only one))" in block  # as this run resolved auto
    assert "  --rollout-num-gpus 8 (upstream: unset (every trainer GPU with --colocate))" in block
    assert "  --use-wandb on (upstream: off)" in block and "  --log-probs-chunk-size 0 (upstream: -1 (the whole " \
        "micro-batch))" in block
    # upstream's script gives --input-key, --global-batch-size, --num-layers, ...: those are not listed; the
    # model-shape flags it leaves out share one line
    left = [f for f in DEFAULTS_DIFFER if f not in UPSTREAM_RUN_QWEN3_4B]
    shape = [f for f in left if f in MODEL_SHAPE_FLAGS]
    assert len(shape) == 4 and block[-1] == f"  {', '.join(shape)}: from --hf-checkpoint's config.json (upstream: " \
        "these flags)"
    assert [line.split()[0] for line in block[:-1]] == [f for f in left if f not in shape]
    # a flag given under its other name, or as its --no- form, is given
    given = parse_args(local_argv(qwen3_4b) + ["--sglang-router-policy", "cache_aware", "--no-use-wandb", "--dry-run"])
    named = [line.split()[0] for line in upstream_defaults_left(given)[1:-1]]
    assert named == [f for f in left if f not in shape + ["--router-policy", "--use-wandb"]]
    assert upstream_defaults_left(a.replace(given_flags=tuple(DEFAULTS_DIFFER))) == []


# plugins written to upstream's signatures (our code), and broken ones
async def generate(args, sample, sampling_params):
    return sample


def generate_sync(args, sample, sampling_params):
    return sample


async def generate_two(args, sample):
    return sample


def buffer_filter(args, rollout_id, buffer, num_samples):
    return buffer[:num_samples]


def buffer_filter_two(args, buffer):
    return buffer


def dynamic_filter(args, samples, **kwargs):
    return True


def rollout(args, rollout_id, data_source, evaluation=False):
    return []


async def reward(args, sample, **kwargs):
    return 1.0


def test_plugins_are_imported_and_their_signatures_checked(qwen3_4b, capsys):
    ok = ["--custom-generate-function-path", "test_dry_run.generate", "--buffer-filter-path", "test_dry_run.buffer_filter",
          "--dynamic-sampling-filter-path", "test_dry_run.dynamic_filter", "--rollout-function-path", "test_dry_run.rollout",
          "--eval-function-path", "tests.upstream_plugins.generate_rollout", "--custom-rm-path", "test_dry_run.reward"]
    base = local_argv(qwen3_4b)
    assert dry_run("train.py", parse_args(base + ok + ["--dry-run"])) == 0
    assert "error:" not in capsys.readouterr().out
    for flags, error in [
        (["--custom-generate-function-path", "test_dry_run.generate_sync"], "must be an async function"),
        (["--custom-generate-function-path", "test_dry_run.generate_two"], "does not take upstream's async (args, "
                                                                            "sample, sampling_params)"),
        (["--buffer-filter-path", "test_dry_run.no_such_filter"], "has no attribute 'no_such_filter'"),
        (["--buffer-filter-path", "test_dry_run.buffer_filter_two"], "TypeError: --buffer-filter-path "
                                                                      "test_dry_run.buffer_filter_two takes 2"),
        (["--custom-rm-path", "no_such_module.reward"], "cannot import module 'no_such_module'"),
    ]:
        assert dry_run("train.py", parse_args(base + flags + ["--dry-run"])) == 2
        assert f"error: {flags[0]} {flags[1]}: " in (text := capsys.readouterr().out) and error in text, text
