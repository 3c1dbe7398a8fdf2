"""Build tiny Qwen3-architecture models and word-level tokenizers in code.

No model hub is reachable on our CPU machines, so the embedded default
(tests, benchmarks, the quick start) builds its model here and saves it as a
plain Hugging Face directory that every component loads by path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SPECIAL_TOKENS = {"bos": "<bos>", "eos": "<eos>", "pad": "<pad>"}


def build_tokenizer(words: list[str]):
    """A whitespace-free word-level tokenizer over `words` plus BOS/EOS/PAD.

    Each word is matched greedily as-is (single characters for our tasks), so
    `decode(encode(s)) == s` for strings made of those words.
    """
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


def build_tiny_qwen3(save_dir: str, tokenizer, spec: TinyQwen3Spec = TinyQwen3Spec(), seed: int = 0):
    """Create a randomly initialised Qwen3 causal LM for `tokenizer`, save model + tokenizer, return the model."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(save_dir, exist_ok=True)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return model
