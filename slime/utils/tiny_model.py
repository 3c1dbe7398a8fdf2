"""Build tiny Qwen3-architecture models and word-level tokenizers in code (no model hub on our CPU machines)."""

from __future__ import annotations

import os
from dataclasses import dataclass

SPECIAL_TOKENS = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}


def build_tokenizer(words: list[str]):
    """A word-level tokenizer over `words` plus BOS/EOS/PAD, so `decode(encode(s)) == s`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([SPECIAL_TOKENS["pad"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"], *words])}
    if len(vocab) != len(words) + 3:
        raise ValueError(f"build_tokenizer: duplicate or reserved words in {words}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["pad"]))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated") if all(len(w) == 1 for w in words) else pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"],
        pad_token=SPECIAL_TOKENS["pad"],
        unk_token=SPECIAL_TOKENS["pad"],
    )
    # A trivial chat template: the user's content, as is, after BOS.
    fast.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


@dataclass(frozen=True)
class TinyQwen3Spec:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    vocab_size: int | None = None  # None: the tokenizer's (a larger one has rows no token decodes to)
    dtype: str = "float32"  # the saved weights' dtype (a GPU engine serves a checkpoint in its own dtype)


def model_preset(name: str) -> TinyQwen3Spec:
    """Named shapes for benchmarks: `quickstart`, and `qwen3-0.5b` (Qwen3-0.6B's width with 16 layers, bf16)."""
    if name == "quickstart":
        return TinyQwen3Spec(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=256, max_position_embeddings=272)
    if name == "qwen3-0.5b":
        return TinyQwen3Spec(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                             intermediate_size=3072, max_position_embeddings=16384, tie_word_embeddings=True,
                             head_dim=128, vocab_size=151936, dtype="bfloat16")
    raise ValueError(f"model preset: unknown {name!r} (quickstart, qwen3-0.5b)")


def build_preset(name: str, root: str, tokenizer, seed: int = 0) -> str:
    """`model_preset(name)` built in root/name unless already there; returns its directory."""
    import torch

    path = os.path.join(root, name)
    done = os.path.join(path, ".built")
    if not os.path.exists(done):
        build_tiny_qwen3(path, tokenizer, model_preset(name), seed=seed,
                         init_device="cuda" if torch.cuda.is_available() else "cpu")
        open(done, "w").close()
    return path


def build_tiny_qwen3(save_dir: str, tokenizer, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0,
                     init_device: str = "cpu"):
    """Create a randomly initialised Qwen3 causal LM for `tokenizer`, save model + tokenizer, return the model
    (on `init_device`, where its random weights were drawn)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if spec.vocab_size is not None and spec.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {spec.vocab_size} < the tokenizer's {len(tokenizer)} tokens")
    config = Qwen3Config(
        vocab_size=spec.vocab_size or len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim or spec.hidden_size // spec.num_attention_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        dtype=spec.dtype,
    )
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec.dtype))
    os.makedirs(save_dir, exist_ok=True)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return model
