"""Megatron's flags under slime's names."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from slime.arguments import ArgumentError, parse_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Published Qwen3 configs (huggingface.co/Qwen/Qwen3-*/config.json): layers, hidden, ffn, heads, kv heads, tied
QWEN3 = {
    "qwen3-0.6B": (28, 1024, 3072, 16, 8, True),
    "qwen3-1.7B": (28, 2048, 6144, 16, 8, True),
    "qwen3-4B": (36, 2560, 9728, 32, 8, True),
    "qwen3-8B": (36, 4096, 12288, 32, 8, False),
    "qwen3-14B": (40, 5120, 17408, 40, 8, False),
    "qwen3-32B": (64, 5120, 25600, 64, 8, False),
}


def qwen3_config(layers, hidden, ffn, heads, kv, tied, vocab=151936, head_dim=128, theta=1000000.0) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_theta": theta, "tie_word_embeddings": tied, "attention_bias": False,
            "max_position_embeddings": 40960}


def model_args(script: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "{script}"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.fixture
def base(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "1 1=", "label": "0"}) + "\n")

    def _base(config: dict, *extra: str) -> list[str]:
        model = tmp_path / "model"
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(config))
        return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rm-type", "math",
                "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--num-rollout", "3", *extra]

    return _base


@pytest.mark.parametrize("name", sorted(QWEN3))
def test_qwen3_model_scripts_parse_against_their_config(base, name, monkeypatch):
    monkeypatch.setattr("slime.arguments.megatron.megatron_importable", lambda: True)
    argv = model_args(os.path.join(REPO, "scripts", "models", f"{name}.sh"))
    a = parse_args(base(qwen3_config(*QWEN3[name]), "--train-backend", "megatron", *argv))
    layers, hidden, ffn, heads, kv, tied = QWEN3[name]
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups) == (
        layers, hidden, ffn, heads, kv)
    assert a.qk_layernorm and a.swiglu and a.untie_embeddings_and_output_weights is (None if tied else True)
    # the same flags against another size's checkpoint fail, naming the flag
    other = "qwen3-32B" if name != "qwen3-32B" else "qwen3-8B"
    with pytest.raises(ArgumentError, match=r"^model-shape flags: .*--num-layers|^model-shape flags: .*--hidden-size"):
        parse_args(base(qwen3_config(*QWEN3[other]), "--train-backend", "megatron", *argv))


def test_tiny_model_script_matches_the_quick_start_model(base, monkeypatch):
    from slime.utils.tiny_model import TinyQwen3Spec

    monkeypatch.setattr("slime.arguments.megatron.megatron_importable", lambda: True)
    spec = TinyQwen3Spec()  # what tools/prepare_tiny_task.py builds by default
    cfg = qwen3_config(spec.num_hidden_layers, spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                       spec.num_key_value_heads, spec.tie_word_embeddings, vocab=16,
                       head_dim=spec.hidden_size // spec.num_attention_heads, theta=10000.0)
    argv = model_args(os.path.join(REPO, "scripts", "models", "tiny-qwen3.sh"))
    assert parse_args(base(cfg, "--train-backend", "megatron", *argv)).vocab_size == 16


def test_slime_perf_optimizer_and_misc_args_parse(base, monkeypatch):
    monkeypatch.setattr("slime.arguments.megatron.megatron_importable", lambda: True)
    perf = ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 "
            "--context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 "
            "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
            "--use-dynamic-batch-size --max-tokens-per-gpu 9216").split()
    optim = "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98"
    misc = ("--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 "
            "--attention-softmax-in-fp32 --attention-backend flash --bf16 --use-distributed-optimizer")
    grpo = "--use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28"
    a = parse_args(base(qwen3_config(*QWEN3["qwen3-4B"]), "--train-backend", "megatron", "--actor-num-gpus-per-node",
                        "8", *perf, *optim.split(), *misc.split(), *grpo.split(),
                        *model_args(os.path.join(REPO, "scripts", "models", "qwen3-4B.sh"))))
    assert a.tensor_model_parallel_size == 2 and a.sequence_parallel and a.recompute_granularity == "full"
    assert a.bf16 and a.attention_backend == "flash" and a.max_tokens_per_gpu == 9216


@pytest.mark.parametrize("extra, flag, why", [
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size", "pipeline parallelism"),
    (["--context-parallel-size", "2"], "--context-parallel-size", "context parallelism"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size", "MoE"),
    (["--fp16"], "--fp16", "use --bf16"),
    (["--use-rope-scaling"], "--use-rope-scaling", "rope scaling"),
    (["--attention-backend", "fused"], "--attention-backend fused", "TransformerEngine"),
    (["--rotary-percent", "0.5"], "--rotary-percent", "only 1.0"),
    (["--sequence-parallel"], "--sequence-parallel", "--tensor-model-parallel-size > 1"),
    (["--overlap-param-gather"], "--overlap-param-gather", "needs --overlap-grad-reduce"),
    (["--overlap-grad-reduce", "--overlap-param-gather", "--no-use-distributed-optimizer"], "--overlap-param-gather",
     "needs --use-distributed-optimizer"),
    (["--recompute-granularity", "full"], "--recompute-method", "is required"),
    (["--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size",
     "must divide the trainer ranks"),
    (["--actor-num-gpus-per-node", "16", "--tensor-model-parallel-size", "16"], "--tensor-model-parallel-size",
     "must divide the attention heads"),
    (["--normalization", "LayerNorm"], "model-shape flags", "uses RMSNorm"),
    (["--add-qkv-bias"], "model-shape flags", "--add-qkv-bias is set"),
    (["--lr-decay-style", "cosine", "--num-rollout", "3"], None, None),  # fills --lr-decay-iters: accepted
])
def test_unsupported_or_inconsistent_flags_fail_with_a_reason(base, extra, flag, why, monkeypatch):
    monkeypatch.setattr("slime.arguments.megatron.megatron_importable", lambda: True)
    argv = base(qwen3_config(*QWEN3["qwen3-4B"]), "--train-backend", "megatron", *extra)
    if flag is None:
        assert parse_args(argv).lr_decay_iters == 3
        return
    with pytest.raises(ArgumentError) as e:
        parse_args(argv)
    assert str(e.value).startswith(flag + ":") and why in str(e.value)


@pytest.mark.parametrize("extra", [["--attention-backend", "unfused"],
                                   ["--tensor-model-parallel-size", "1", "--use-distributed-optimizer"],
                                   ["--overlap-grad-reduce"],
                                   ["--lr-decay-style", "linear", "--lr-decay-iters", "5"]])
def test_fsdp_refuses_megatron_only_flags(base, extra):
    with pytest.raises(ArgumentError, match="supported by --train-backend megatron only"):
        parse_args(base(qwen3_config(*QWEN3["qwen3-0.6B"]), "--train-backend", "fsdp", *extra))


def test_fsdp_takes_bf16_mixed_precision(base):
    assert parse_args(base(qwen3_config(*QWEN3["qwen3-0.6B"]), "--train-backend", "fsdp", "--bf16")).bf16


def test_auto_backend_is_fsdp_without_cuda(base):
    import torch

    a = parse_args(base(qwen3_config(*QWEN3["qwen3-0.6B"])))
    assert a.train_backend == ("megatron" if torch.cuda.is_available() else "fsdp")


def test_megatron_needs_a_supported_architecture(base, monkeypatch):
    monkeypatch.setattr("slime.arguments.megatron.megatron_importable", lambda: True)
    cfg = {**qwen3_config(*QWEN3["qwen3-0.6B"]), "model_type": "gpt_neox"}
    with pytest.raises(ArgumentError, match="--hf-checkpoint: .*model_type 'gpt_neox' is not supported"):
        parse_args(base(cfg, "--train-backend", "megatron"))
    # FSDP trains any HF causal LM (no shape check without model-shape flags)
    assert parse_args(base(cfg, "--train-backend", "fsdp")).train_backend == "fsdp"
