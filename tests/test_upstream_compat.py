"""Upstream slime's plugins and flags, unchanged."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from slime.arguments import ArgumentError, build_parser, parse_args
from slime.upstream_flags import REFUSED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

UPSTREAM_FLAGS = """
--accumulate-allreduce-grads-in-fp32 --actor-num-gpus-per-node --actor-num-nodes --adam-beta1 --adam-beta2
--add-qkv-bias --advantage-estimator --allgather-cp --apply-chat-template --apply-chat-template-kwargs
--apply-layernorm-1p --async-save --attention-backend --attention-dropout --attention-output-gate
--attention-softmax-in-fp32 --balance-by-flops --balance-data --bf16 --buffer-filter-path
--calculate-per-token-loss --check-weight-update-equal --ci-disable-kl-checker --ci-load-grad-norm
--ci-save-grad-norm --ci-test --ci-train-rollout-logprob-abs-diff-threshold --clip-grad --colocate
--context-parallel-size --custom-advantage-function-path --custom-config-path
--custom-convert-samples-to-train-data-path --custom-eval-rollout-log-function-path
--custom-generate-function-path --custom-loss-function-path --custom-megatron-before-log-prob-hook-path
--custom-megatron-before-train-step-hook-path --custom-megatron-init-path --custom-model-provider-path
--custom-pg-loss-reducer-function-path --custom-reward-post-process-path --custom-rm-path
--custom-rollout-log-function-path --custom-tis-function-path --custom-update-weight-post-write-path
--data-pad-size-multiplier --data-source-path --debug-rollout-only --debug-train-only
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --deterministic-mode
--disable-bias-linear --disable-compute-advantages-and-returns --disable-grpo-std-normalization
--disable-rewards-normalization --disable-rollout-global-dataset --disable-wandb-random-suffix
--distributed-backend --distributed-timeout-minutes --dump-details --dynamic-sampling-filter-path
--enable-mtp-training --entropy-coef --eps-clip --eps-clip-c --eps-clip-high --eval-config --eval-function-path
--eval-input-key --eval-interval --eval-label-key --eval-max-context-len --eval-max-prompt-len
--eval-max-response-len --eval-min-new-tokens --eval-prompt-data --eval-reward-key --eval-temperature
--eval-tool-key --eval-top-k --eval-top-p --expert-model-parallel-size --expert-tensor-parallel-size
--fetch-trajectory-retry-times --ffn-hidden-size --fp8-format --fp8-param-gather --fp8-recipe --freeze-indexer
--freeze-params-name-list --gamma --get-mismatch-metrics --global-batch-size --group-query-attention --group-rm
--hf-checkpoint --hidden-dropout --hidden-size --http-proxy --input-key --keep-old-actor --kl-coef
--kl-loss-coef --kl-loss-type --kv-channels --kv-lora-rank --label-key --lambd --load --load-debug-rollout-data
--load-debug-rollout-data-subsample --load-forge-rollout-data --log-correct-samples --log-multi-turn
--log-passrate --log-probs-chunk-size --log-probs-max-tokens-per-gpu --log-reward-category --loss-mask-type
--loss-type --lr --lr-decay-style --lr-warmup-fraction --make-vocab-size-divisible-by
--mask-offpolicy-in-partial-rollout --max-position-embeddings --max-tokens-per-gpu --megatron-config-path
--megatron-deepgemm-forward-layers --megatron-deepgemm-forward-modules --megatron-deepgemm-moe-forward-layers
--megatron-deepgemm-moe-forward-modules --memory-recorder --memory-snapshot-dir --memory-snapshot-num-steps
--metadata-key --micro-batch-size --min-batch-collection-ratio --min-lr --model-name --moe-aux-loss-coeff
--moe-enable-deepep --moe-ffn-hidden-size --moe-grouped-gemm --moe-layer-freq --moe-permute-fusion
--moe-router-bias-update-rate --moe-router-dtype --moe-router-enable-expert-bias --moe-router-group-topk
--moe-router-load-balancing-type --moe-router-num-groups --moe-router-pre-softmax --moe-router-score-function
--moe-router-topk --moe-router-topk-scaling-factor --moe-shared-expert-gate
--moe-shared-expert-intermediate-size --moe-token-dispatcher-type --moe-token-drop-policy --mscale
--mscale-all-dim --mtp-loss-scaling-factor --mtp-num-layers --multi-latent-attention --multimodal-keys
--n-samples-per-eval-prompt --n-samples-per-prompt --no-check-for-nan-in-loss-and-grad
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-offload-rollout --no-offload-train
--no-position-embedding --no-rope-fusion --no-save-optim --norm-epsilon --normalization --normalize-advantages
--num-attention-heads --num-critic-only-steps --num-epoch --num-experts --num-gpus-per-node --num-layers
--num-query-groups --num-rollout --num-steps-per-rollout --offload --offload-rollout --offload-train
--only-train-params-name-list --opd-kl-coef --opd-teacher-ckpt-step --opd-teacher-load --opd-type --opsm-delta
--optimizer --optimizer-cpu-offload --over-sampling-batch-size --over-sampling-filter-input-size
--over-sampling-filter-path --overlap-cpu-optimizer-d2h-h2d --padded-vocab-size --partial-rollout
--pipeline-model-parallel-size --position-embedding-type --post-mlp-layernorm --post-self-attn-layernorm
--profile-target --prompt-data --q-lora-rank --qk-head-dim --qk-layernorm --qk-pos-emb-head-dim
--qwen-gdn-backend --recompute-granularity --recompute-loss-function --recompute-method --recompute-num-layers
--record-memory-history --ref-ckpt-step --ref-load --ref-micro-batch-size --ref-update-interval --release-train
--reset-optimizer-states --reward-key --rm-type --rm-url --rollout-all-samples-process-path --rollout-batch-size
--rollout-buffer-url --rollout-data-postprocess-path --rollout-data-transport --rollout-external-engine-addrs
--rollout-function-path --rollout-health-check-first-wait --rollout-health-check-interval
--rollout-health-check-timeout --rollout-max-context-len --rollout-max-prompt-len --rollout-max-response-len
--rollout-num-gpus --rollout-num-gpus-per-engine --rollout-sample-filter-path --rollout-sample-hook-path
--rollout-seed --rollout-shuffle --rollout-skip-special-tokens --rollout-stop --rollout-stop-token-ids
--rollout-task-type --rollout-temperature --rollout-top-k --rollout-top-p --rotary-base --rotary-interleaved
--rotary-percent --rotary-scaling-factor --save --save-debug-rollout-data --save-debug-train-data --save-hf
--save-interval --seed --seq-length --sequence-parallel --skip-eval-before-train --spec --start-rollout-id
--swiglu --tb-experiment-name --tb-project-name --tensor-model-parallel-size --tis-clip --tis-clip-low
--tool-key --train-backend --train-env-vars --transformer-impl --untie-embeddings-and-output-weights
--update-weight-buffer-size --update-weight-delta-checksum --update-weight-delta-encoding
--update-weight-disk-dir --update-weight-disk-keep-files --update-weight-local-checkpoint-dir
--update-weight-mode --update-weight-transport --update-weights-interval --use-distributed-optimizer
--use-distributed-post --use-dynamic-batch-size --use-fault-tolerance --use-gated-attention --use-http2
--use-kl-loss --use-opd --use-opsm --use-precision-aware-optimizer --use-rollout-entropy --use-rollout-logprobs
--use-rollout-routing-replay --use-rope-scaling --use-rotary-position-embeddings --use-routing-replay
--use-stateless-adam --use-tensorboard --use-tis --use-unbiased-kl --use-wandb --v-head-dim --value-clip
--vocab-size --wandb-always-use-train-step --wandb-dir --wandb-group --wandb-host --wandb-key --wandb-mode
--wandb-project --wandb-run-id --wandb-team --weight-decay
--prefill-num-servers --sglang-config --sglang-router-ip --sglang-router-port --sglang-router-request-timeout-secs
--sglang-server-concurrency --router-policy --router-log-level
""".split()


def our_flags() -> set[str]:
    return {o for entry in ("train.py", "train_async.py") for a in build_parser(entry)._actions for o in a.option_strings}


def minimal(tmp_path) -> list[str]:
    (tmp_path / "hf").mkdir(exist_ok=True)
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "label": "2"}\n')
    return ["--hf-checkpoint", str(tmp_path / "hf"), "--prompt-data", str(tmp_path / "p.jsonl"), "--rm-type", "math",
            "--rollout-batch-size", "1", "--num-rollout", "1", "--run-dir", str(tmp_path / "run")]


def test_every_upstream_flag_is_taken_or_says_what_to_use_instead(tmp_path):
    ours = our_flags()
    assert not set(REFUSED) & ours  # a flag is one or the other
    assert set(REFUSED) <= set(UPSTREAM_FLAGS)  # and only upstream's are refused
    base = minimal(tmp_path)
    for flag in UPSTREAM_FLAGS:
        if flag in ours:
            continue
        assert flag in REFUSED, f"{flag}: upstream slime has it; take it or say what to use instead"
        with pytest.raises(ArgumentError) as e:
            parse_args(base + [flag, "1"])
        msg = str(e.value)
        assert msg.startswith(f"{flag}: upstream slime's flag is not taken here: ") and REFUSED[flag] in msg
        with pytest.raises(ArgumentError, match="unrecognized argument: --not-a-flag"):
            parse_args(base + ["--not-a-flag"])


# The APRIL repository's run script's command line (its MODEL_ARGS, CKPT_ARGS, ROLLOUT_ARGS, EVAL_ARGS, PERF_ARGS,
# GRPO_ARGS, OPTIMIZER_ARGS, WANDB_ARGS, SGLANG_ARGS, MISC_ARGS), paths and the key substituted.
APRIL_SCRIPT = """
--actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear --normalization RMSNorm --norm-epsilon 1e-6
--rotary-base 1000000 --vocab-size 151936 --kv-channels 128 --qk-layernorm
--hf-checkpoint {model} --ref-load {model} --load {ckpt} --save {ckpt} --save-interval 20000
--prompt-data {data} --input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler
--num-epoch 1 --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 16384 --rollout-temperature 0.8
--global-batch-size 256 --balance-data --partial-rollout --over-sampling-batch-size 64
--eval-interval 10 --eval-prompt-data aime {data} --n-samples-per-eval-prompt 16 --eval-max-response-len 16384
--eval-top-p 0.7
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full --recompute-method uniform
--recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--use-wandb --wandb-project APRIL --wandb-group dapo-qwen3-4B-grpo-partial --wandb-key {key}
--rollout-num-gpus-per-engine 2 --sglang-mem-fraction-static 0.6
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --no-gradient-accumulation-fusion
"""


def test_the_april_repositorys_run_script_parses_as_it_is(tmp_path):
    from test_megatron_args import QWEN3, qwen3_config

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(qwen3_config(*QWEN3["qwen3-4B"])))
    (tmp_path / "dapo.jsonl").write_text('{"prompt": "1+1?", "label": "2"}\n')
    argv = APRIL_SCRIPT.format(model=tmp_path / "model", ckpt=tmp_path / "ckpt", data=tmp_path / "dapo.jsonl",
                               key="k" * 40).split()
    # upstream always trains with Megatron; here auto picks it only where CUDA is
    a = parse_args(argv + ["--train-backend", "megatron"])
    assert (a.rollout_batch_size, a.over_sampling_batch_size, a.partial_rollout, a.colocate) == (32, 64, True, True)
    assert (a.tensor_model_parallel_size, a.num_engines, a.balance_data, a.wandb_mode) == (2, 4, True, "online")
    assert a.sglang_extra_args == {"mem-fraction-static": "0.6"} and a.eval_datasets == [("aime", str(tmp_path / "dapo.jsonl"))]


def test_upstream_flags_that_map_onto_ours(tmp_path):
    base = minimal(tmp_path)
    a = parse_args(base + ["--num-steps-per-rollout", "1", "--n-samples-per-prompt", "4", "--rollout-batch-size", "2",
                           "--rollout-skip-special-tokens", "--eval-top-k", "5", "--skip-eval-before-train"])
    assert a.global_batch_size == 8 and a.eval_top_k == 5 and a.rollout_top_k == -1
    from slime.rollout.sampling_request import sampling_params_from_args

    assert sampling_params_from_args(a)["skip_special_tokens"] is True
    assert sampling_params_from_args(a, evaluation=True)["top_k"] == 5
    with pytest.raises(ArgumentError, match="--num-steps-per-rollout"):
        parse_args(base + ["--num-steps-per-rollout", "3", "--global-batch-size", "1"])
    with pytest.raises(ArgumentError, match="--offload-rollout: needs --colocate"):
        parse_args(base + ["--offload-rollout"])
    with pytest.raises(SystemExit):  # argparse names the flag and explains upstream's values
        parse_args(base + ["--update-weight-mode", "full"])
    assert parse_args(base + ["--wandb-key", "k" * 40]).wandb_mode == "online"
    assert parse_args(base).wandb_mode == "offline"


def test_balance_data_gives_each_rank_about_the_same_tokens():
    from slime.backends.training_utils.data import plan_micro_batches

    items = [SimpleNamespace(pos=i, num_tokens=n) for i, n in enumerate([50, 1, 50, 1, 50, 1, 50, 1, 7])]

    def loads(plan):
        return [sum(it.num_tokens for mb in rank for it in mb) for rank in plan]

    strided, balanced = plan_micro_batches(items, 2, 2), plan_micro_batches(items, 2, 2, balance=True)
    assert sorted(it.pos for rank in balanced for mb in rank for it in mb) == list(range(9))  # each item once
    assert loads(strided) == [207, 4] and sorted(loads(balanced)) == [104, 107]
    assert all(len(mb) <= 2 for rank in balanced for mb in rank)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from slime.tasks import subtract_chain as task
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    d = tmp_path_factory.mktemp("upstream")
    task.write_dataset(str(d / "train.jsonl"), 100, seed=1, cap=16)
    task.write_dataset(str(d / "eval.jsonl"), 4, seed=2, cap=16)
    build_tiny_qwen3(str(d / "model"), build_tokenizer(task.VOCAB),
                     TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, intermediate_size=64, max_position_embeddings=256))
    return d


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_upstream_rollout_function_and_plugins_train_through_train_py(workdir):
    """An upstream-shaped rollout function with a custom generate and reward, its state on args kept across the run."""
    out = workdir / "rollout_fn"
    plugins = "tests.upstream_plugins"
    cmd = [sys.executable, os.path.join(REPO, "train.py"), "--hf-checkpoint", str(workdir / "model"),
           "--prompt-data", str(workdir / "train.jsonl"), "--input-key", "prompt", "--label-key", "label",
           "--rollout-function-path", f"{plugins}.generate_rollout_with_plugins",
           "--custom-generate-function-path", f"{plugins}.generate_with_state", "--custom-rm-path", f"{plugins}.dapo_reward",
           "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "24",
           "--num-rollout", "2", "--lr", "1e-4", "--eval-prompt-data", "aime", str(workdir / "eval.jsonl"),
           "--eval-interval", "2", "--skip-eval-before-train", "--run-dir", str(out / "run"),
           "--save-debug-rollout-data", str(out / "rollouts" / "r{rollout_id}.json")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the effective precision, optimizer sharding and offload, in one line at start-up
    assert "trainer fsdp: fp32 weights, compute and Adam state; optimizer state sharded over 1 rank(s) (FSDP2); " \
           "trainer on its own devices (not colocated)" in open(out / "run" / "train.log").read()
    steps = [r for r in map(json.loads, open(out / "run" / "metrics.jsonl")) if r["step"] >= 0]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:
        assert r["upstream/samples"] == r["train/num_samples"] == 4 and r["train/grad_norm"] >= 0
        assert r["ledger/issued"] == 0 and r["ledger/trained"] == 2 * (r["step"] + 1)  # every group settled
    # the counts the plugins kept on args grow across steps: one args object for the whole run
    assert [r["upstream/generate_calls"] for r in steps] == [4, 8] and steps[0]["upstream/rewards"] == 4
    assert "eval/upstream_eval/mean" in steps[-1]
    dumped = json.load(open(out / "rollouts" / "r1.json"))["groups"]
    for g in dumped:  # what the function left out was filled in: one version per token, all in the loss
        for s in g:
            assert len(s["weight_versions"]) == len(s["loss_mask"]) == len(s["rollout_log_probs"]) == s["response_length"]
            assert set(s["weight_versions"]) == {1} and set(s["loss_mask"]) == {1}


def test_the_docs_list_every_upstream_flag():
    doc = open(os.path.join(REPO, "docs", "upstream-flags.md")).read()
    missing = [f for f in UPSTREAM_FLAGS if f"`{f}`" not in doc]
    assert not missing, f"docs/upstream-flags.md does not list {missing}"
    listed = {}  # the refused table: each row's flags share its reason
    refused_section = doc.split("## Refused, with what to use instead\n", 1)[1]
    for cell, why in re.findall(r"^\| ((?:`--[a-z0-9-]+`(?:, )?)+) \| (.*) \|$", refused_section, re.M):
        for flag in re.findall(r"`(--[a-z0-9-]+)`", cell):
            listed[flag] = why
    for flag, instead in REFUSED.items():
        assert listed.get(flag) == instead, flag
