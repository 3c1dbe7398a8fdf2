"""Dataset rows -> groups of fresh `Sample`s (`RolloutDataSource`), and eval sets.

Reading:
- `.jsonl` is read line by line with `json` (one object per non-blank line).
  HF `datasets` is not used for it: its JSON loader rejects blank lines and
  columns whose type changes between rows (an int label in one row, a string
  in the next), fills missing keys with None, and its errors name no row.
- `.json` holds a list of objects (or is JSON lines).
- `.parquet` is read with HF `datasets` offline (cache in a temporary dir).

A prompt is a string or a list of chat messages `{"role", "content"}`. With
`--apply-chat-template` it goes through `tokenizer.apply_chat_template(...,
tokenize=False, add_generation_prompt=True)` (a string becomes one user
message) and the text is tokenised without special tokens (the template has
them); a plain string prompt is tokenised with the tokenizer's defaults.
`Sample.prompt` holds the text that was tokenised. Prompts longer than
`--rollout-max-prompt-len` tokens are dropped at load (logged, counted in
`num_dropped_too_long`).

Ids: training groups get `group_index` 0, 1, 2, ... and samples `index` 0,
1, 2, ... (run-wide counters saved in `state_dict`). Eval groups
(`load_eval_groups`) get negative ids (group -1, -2, ...; sample -1, -2, ...)
so they can never collide with training ids; they are unique within one eval
set and carry `metadata["eval_name"]`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import tempfile
from dataclasses import dataclass
from typing import Any

from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and key."""


@dataclass
class PromptEntry:
    """One usable dataset row, prepared once at load."""

    row: int  # 0-based row number in the file
    prompt: str  # the text that was tokenised
    tokens: list[int]
    label: Any
    metadata: dict[str, Any]


# ---------------------------------------------------------------- reading ----
def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: row {len(rows)} (line {lineno}): invalid JSON: {e.msg} at column {e.colno}") from e
            rows.append((lineno, obj))
    return rows


def _read_parquet(path: str) -> list[tuple[int, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    with tempfile.TemporaryDirectory(prefix="slime-datasets-") as cache_dir:
        ds = datasets.load_dataset("parquet", data_files=path, split="train", cache_dir=cache_dir, keep_in_memory=True)
        return [(None, row) for row in ds.to_list()]


def read_rows(path: str, flag: str = "--prompt-data") -> list[dict[str, Any]]:
    """All rows of a local `.jsonl` / `.json` / `.parquet` file as dicts; errors name the file and row."""
    if not path:
        raise DataError(f"{flag} is not set")
    if not os.path.isfile(path):
        raise DataError(f"{flag} file not found: {path}")
    if path.endswith(".parquet"):
        items = _read_parquet(path)
    elif path.endswith(".jsonl"):
        items = _read_jsonl(path)
    elif path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
        if head.startswith("["):
            with open(path, encoding="utf-8") as f:
                try:
                    items = [(None, obj) for obj in json.load(f)]
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: invalid JSON: {e.msg} at line {e.lineno}") from e
        else:
            items = _read_jsonl(path)
    else:
        raise DataError(f"{flag} {path}: unsupported file type (expected .jsonl, .json or .parquet)")
    rows = []
    for i, (lineno, obj) in enumerate(items):
        if not isinstance(obj, dict):
            where = f"row {i}" + (f" (line {lineno})" if lineno else "")
            raise DataError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
        rows.append(obj)
    return rows


# ------------------------------------------------------------- preparing ----
def _check_messages(messages: list, where: str, key: str) -> list[dict[str, str]]:
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: key {key!r}: message {j} must be an object with string 'role' and 'content', got {str(m)[:120]}")
    return messages


def _prompt_text(prompt: Any, args, tokenizer, where: str, key: str) -> tuple[str, bool]:
    """(text to tokenise, whether it came from the chat template)."""
    if isinstance(prompt, list):
        messages = _check_messages(prompt, where, key)
        if not args.apply_chat_template:
            raise DataError(f"{where}: key {key!r} holds chat messages; pass --apply-chat-template to render them")
    elif isinstance(prompt, str):
        if not args.apply_chat_template:
            return prompt, False
        messages = [{"role": "user", "content": prompt}]
    else:
        raise DataError(f"{where}: key {key!r} must be a string or a list of chat messages, got {type(prompt).__name__}")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:
        raise DataError(f"{where}: key {key!r}: the tokenizer's chat template failed: {e}") from e
    return text, True


def _metadata(raw: Any, where: str, key: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if isinstance(raw, str):  # some datasets store metadata as a JSON string
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: key {key!r}: metadata string is not JSON: {e.msg}") from e
    if not isinstance(raw, dict):
        raise DataError(f"{where}: key {key!r}: metadata must be an object, got {type(raw).__name__}")
    return dict(raw)


def prepare_entries(args, tokenizer, path: str, flag: str = "--prompt-data") -> tuple[list[PromptEntry], int]:
    """Read, validate, template and tokenise every row of `path`; return (entries, number dropped as too long)."""
    input_key, label_key, metadata_key = args.input_key, args.label_key, args.metadata_key
    max_len = args.rollout_max_prompt_len
    entries, dropped = [], 0
    for i, row in enumerate(read_rows(path, flag)):
        where = f"{path}: row {i}"
        if input_key not in row:
            raise DataError(f"{where}: missing key {input_key!r} (--input-key); row has {sorted(row)}")
        if label_key is not None and label_key not in row:
            raise DataError(f"{where}: missing key {label_key!r} (--label-key); row has {sorted(row)}")
        text, templated = _prompt_text(row[input_key], args, tokenizer, where, input_key)
        tokens = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
        if max_len is not None and len(tokens) > max_len:
            dropped += 1
            continue
        metadata = _metadata(row.get(metadata_key), where, metadata_key)
        metadata["row"] = i
        label = row[label_key] if label_key is not None else None
        entries.append(PromptEntry(row=i, prompt=text, tokens=tokens, label=label, metadata=metadata))
    if dropped:
        logger.info("%s: dropped %d of %d prompts longer than --rollout-max-prompt-len=%s tokens", path, dropped, dropped + len(entries), max_len)
    return entries, dropped


def _make_group(entry: PromptEntry, group_index: int, first_index: int, n: int, step: int = 1, extra: dict | None = None) -> list[Sample]:
    template = Sample(
        group_index=group_index,
        prompt=entry.prompt,
        tokens=list(entry.tokens),
        label=copy.deepcopy(entry.label),
        metadata={**copy.deepcopy(entry.metadata), **(extra or {})},
        status=Status.PENDING,
    )
    group = []
    for k in range(n):
        s = copy.deepcopy(template)
        s.index = first_index + step * k
        group.append(s)
    return group


# ----------------------------------------------------------- data source ----
class RolloutDataSource:
    """Fresh prompt groups for training, epoch after epoch, with exact resume.

    Order: the rows in file order, or, with `--rollout-shuffle`, epoch `e`
    uses the permutation from `random.Random(--rollout-seed + e)`. When an
    epoch runs out mid-request the next epoch starts automatically (`epoch`
    tells which; `--num-epoch` is enforced by the caller).
    """

    def __init__(self, args, tokenizer):
        self.args = args
        self.path = args.prompt_data
        self.entries, self.num_dropped_too_long = prepare_entries(args, tokenizer, self.path)
        if not self.entries:
            raise DataError(
                f"--prompt-data {self.path}: no usable prompts"
                + (f" ({self.num_dropped_too_long} longer than --rollout-max-prompt-len)" if self.num_dropped_too_long else "")
            )
        self.n_samples_per_prompt = args.n_samples_per_prompt
        self.shuffle = args.rollout_shuffle
        self.seed = args.rollout_seed
        self.epoch = 0
        self.offset = 0  # position in the current epoch's order
        self.group_counter = 0
        self.sample_counter = 0
        self._order = self._order_for(0)

    def __len__(self) -> int:
        return len(self.entries)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.entries)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` fresh groups of `--n-samples-per-prompt` PENDING samples each."""
        if num_groups < 0:
            raise ValueError(f"get_groups: num_groups must be >= 0, got {num_groups}")
        n = self.n_samples_per_prompt
        groups = []
        for _ in range(num_groups):
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_for(self.epoch)
                logger.info("data source %s: starting epoch %d", self.path, self.epoch)
            entry = self.entries[self._order[self.offset]]
            self.offset += 1
            groups.append(_make_group(entry, self.group_counter, self.sample_counter, n, extra={"epoch": self.epoch}))
            self.group_counter += 1
            self.sample_counter += n
        return groups

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "group_counter": self.group_counter,
            "sample_counter": self.sample_counter,
            "num_prompts": len(self.entries),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "offset", "group_counter", "sample_counter"} - set(state)
        if missing:
            raise DataError(f"data source state is missing {sorted(missing)}")
        if state.get("num_prompts", len(self.entries)) != len(self.entries):
            raise DataError(
                f"data source state was saved with {state['num_prompts']} prompts but --prompt-data {self.path} "
                f"now yields {len(self.entries)}: the resumed order would not match"
            )
        for key, now in (("shuffle", self.shuffle), ("seed", self.seed)):
            if key in state and state[key] != now:
                logger.warning("data source state has %s=%r but the run now uses %r: the order will differ", key, state[key], now)
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self.group_counter = int(state["group_counter"])
        self.sample_counter = int(state["sample_counter"])
        self._order = self._order_for(self.epoch)


def load_eval_groups(args, tokenizer, name: str, path: str, n_samples: int) -> list[list[Sample]]:
    """Every prompt of an eval set as a group of `n_samples` samples, in file order.

    Uses the same keys, template and length limit as training; ids are
    negative (group -1, -2, ...; sample -1, -2, ...), never touching the
    training counters. `metadata["eval_name"] = name`.
    """
    if n_samples < 1:
        raise DataError(f"eval set {name!r}: n_samples must be >= 1, got {n_samples}")
    entries, dropped = prepare_entries(args, tokenizer, path, flag=f"eval set {name!r}")
    if dropped:
        logger.warning("eval set %r: %d prompts longer than --rollout-max-prompt-len were left out", name, dropped)
    groups = []
    for g, entry in enumerate(entries):
        groups.append(_make_group(entry, -(g + 1), -(g * n_samples + 1), n_samples, step=-1, extra={"eval_name": name}))
    return groups
