"""What a Hugging Face model directory must hold, checked before anything loads it, so a missing or corrupt file
is named instead of a loader's traceback minutes into start-up."""

from __future__ import annotations

import functools
import os

from slime.utils.safe_load import CheckpointFileError, check_safetensors, read_json_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDirError(ValueError):
    """`--hf-checkpoint` (or `--ref-load`) is not a usable model directory; the message names the flag and file."""


def check_hf_checkpoint(path: str, flag: str = "--hf-checkpoint", need_tokenizer: bool = True) -> dict:
    """The directory's config (a dict); raises `ModelDirError` naming what is missing or corrupt."""
    if not os.path.isdir(path):
        raise ModelDirError(f"{flag} {path!r} is not a directory")
    files = sorted(os.listdir(path))
    listing = ", ".join(files[:12]) + (" ..." if len(files) > 12 else "") if files else "nothing"
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelDirError(f"{flag} {path}: not a Hugging Face model directory (no config.json; it holds {listing})")
    try:
        config = read_json_file(config_path)
    except CheckpointFileError as e:
        raise ModelDirError(f"{flag}: {e}") from None
    if not isinstance(config, dict) or not (config.get("model_type") or config.get("architectures")):
        raise ModelDirError(f"{flag} {config_path}: names no model_type or architectures (not a model config)")
    weights = [f for f in files if f.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        raise ModelDirError(f"{flag} {path}: no weight files (*.safetensors / *.bin); it holds {listing}")
    for name in weights:
        if name.endswith(".safetensors"):
            try:
                check_safetensors(os.path.join(path, name))
            except CheckpointFileError as e:
                raise ModelDirError(f"{flag}: {e}") from None
    if need_tokenizer and not any(f in files for f in TOKENIZER_FILES):
        raise ModelDirError(f"{flag} {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); it holds {listing}")
    return config


@functools.lru_cache(maxsize=16)
def eos_token_ids(path: str) -> frozenset[int]:
    """The EOS ids SGLang finishes a request on: `eos_token_id` (an int or a list) of the model directory's
    config.json and generation_config.json; none where neither says (or `path` is no model directory)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json") if path else ():
        try:
            value = read_json_file(os.path.join(path, name)).get("eos_token_id")
        except (CheckpointFileError, OSError, AttributeError):
            continue
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool):
                ids.add(v)
    return frozenset(ids)


def max_positions(config: dict, sglang_extra_args: dict | None = None) -> int | None:
    """The model's context length: `--sglang-context-length` if given, else the config's max positions."""
    extra = sglang_extra_args or {}
    for key in ("context-length", "context_length"):
        if key in extra and extra[key] not in (True, None):
            return int(extra[key])
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(text.get(key), int):
            return int(text[key])
    return None
