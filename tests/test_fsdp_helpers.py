"""Shared helpers for the FSDP trainer tests (no tests here)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from slime.utils.types import Sample, Status

WORDS = list("0123456789+-=")


def make_model_dir(path, seed: int = 0, tie: bool = False) -> str:
    from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

    tok = build_tokenizer(WORDS)
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=128, tie_word_embeddings=tie)
    build_tiny_qwen3(str(path), tok, spec, seed=seed)
    return str(path)


def make_args(hf_dir: str, **over) -> SimpleNamespace:
    base = dict(
        hf_checkpoint=hf_dir, ref_load=None, seed=1, lr=1e-3, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        clip_grad=1.0, global_batch_size=8, micro_batch_size=2, use_dynamic_batch_size=False, max_tokens_per_gpu=None,
        rollout_temperature=1.0, advantage_estimator="grpo", n_samples_per_prompt=4, eps_clip=0.2,
        eps_clip_high=None, eps_clip_c=None, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", kl_coef=0.0,
        entropy_coef=0.0, use_tis=False, tis_clip=2.0, tis_clip_low=0.0, loss_type="policy_loss",
        loss_agg_mode="token_mean", normalize_advantages=False, update_weight_buffer_size=1 << 20,
        update_weights_from_disk=False, train_backend="fsdp", actor_num_nodes=1, actor_num_gpus_per_node=1,
        colocate=False, rollout_num_gpus=1, rollout_num_gpus_per_engine=1,
    )
    base.update(over)
    return SimpleNamespace(**base)


def make_groups(n_groups: int = 2, group_size: int = 4, seed: int = 0, vocab: int = 16,
                rollout_log_probs=None) -> list[list[Sample]]:
    """Random prompt/response groups with distinct rewards inside each group."""
    rng = random.Random(seed)
    groups, idx = [], 0
    for g in range(n_groups):
        prompt = [1] + [rng.randrange(3, vocab) for _ in range(rng.randint(2, 5))]
        group = []
        for j in range(group_size):
            resp = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 7))]
            s = Sample(index=idx, group_index=g, tokens=list(prompt))
            s.append_response(resp, [-1.0] * len(resp), 0)
            s.reward = float(j % 2) + 0.1 * j
            s.status = Status.COMPLETED
            group.append(s)
            idx += 1
        groups.append(group)
    return groups


def reference_log_probs(hf_dir: str, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    """Plain transformers teacher forcing, one sample, no FSDP."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model_log_probs(model, sample, temperature)


@torch.no_grad()
def model_log_probs(model, sample: Sample, temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([sample.tokens])
    logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    p = sample.prompt_length
    tgt = ids[0, p:]
    return logp[p - 1 : -1].gather(-1, tgt[:, None]).squeeze(-1)
