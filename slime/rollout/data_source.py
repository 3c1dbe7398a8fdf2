"""Dataset rows -> groups of fresh `Sample`s (`RolloutDataSource`), and eval sets. Rows the engine would refuse
are dropped at load, named; the saved position counts file rows, so a drop never shifts the next step."""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

from slime.rollout.data_files import DataError, read_rows
from slime.utils.hf_dir import max_positions
from slime.utils.ledger import reason_category
from slime.utils.safe_load import read_json_file
from slime.utils.types import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class PromptEntry:
    """One usable dataset row, prepared once at load."""

    row: int  # 0-based row number in the file
    prompt: str  # the text that was tokenised
    tokens: list[int]
    label: Any
    metadata: dict[str, Any]


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


DROP_EMPTY, DROP_MAX_PROMPT_LEN, DROP_CONTEXT = "empty_prompt", "over_max_prompt_len", "over_context_length"
MAX_LOGGED_DROPS = 10


def model_max_positions(args) -> int | None:
    """The context length the engines refuse prompts against (None when --hf-checkpoint has no config)."""
    config_path = os.path.join(args.hf_checkpoint or "", "config.json")
    if not os.path.isfile(config_path):
        return None
    config = read_json_file(config_path)
    return max_positions(config, args.sglang_extra_args) if isinstance(config, dict) else None


def _is_blank(prompt: Any) -> bool:
    """An empty or whitespace-only prompt (a string, or chat messages with no text): a chat template would wrap
    its markup around nothing, and the model would be trained on a prompt that asks nothing."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(m["content"].strip() for m in prompt)


def _drop_reason(prompt: Any, tokens: list[int], budget: int, max_len: int | None,
                 context: int | None) -> str | None:
    """Why the engine would refuse this row (`category: detail`, a ledger drop reason), or None."""
    if _is_blank(prompt):
        return f"{DROP_EMPTY}: the prompt is empty or whitespace"
    if not tokens:
        return f"{DROP_EMPTY}: the prompt has no tokens"
    if max_len is not None and len(tokens) > max_len:
        return f"{DROP_MAX_PROMPT_LEN}: {len(tokens)} tokens > --rollout-max-prompt-len {max_len}"
    if context is not None and len(tokens) + budget > context:
        return (f"{DROP_CONTEXT}: {len(tokens)} prompt tokens + {budget} response budget > the model's "
                f"{context} positions")
    return None


def prepare_entries(args, tokenizer, path: str, flag: str = "--prompt-data",
                    response_budget: int | None = None) -> tuple[list[PromptEntry | None], dict[int, str]]:
    """Read, validate, template and tokenise every row of `path`: (entries, None where dropped; dropped row ->
    reason). Structural errors raise `DataError` naming the file, line and key."""
    input_key, label_key, metadata_key = args.input_key, args.label_key, args.metadata_key
    max_len = args.rollout_max_prompt_len
    context = model_max_positions(args)
    budget_flag = args.rollout_max_response_len if response_budget is None else response_budget
    entries: list[PromptEntry | None] = []
    dropped: dict[int, str] = {}
    for i, (place, row) in enumerate(read_rows(path, flag)):
        where = f"{path}: {place}"
        if input_key not in row:
            raise DataError(f"{where}: missing key {input_key!r} (--input-key); row has {sorted(row)}")
        if label_key is not None and label_key not in row:
            raise DataError(f"{where}: missing key {label_key!r} (--label-key); row has {sorted(row)}")
        text, templated = _prompt_text(row[input_key], args, tokenizer, where, input_key)
        tokens = list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
        metadata = _metadata(row.get(metadata_key), where, metadata_key)
        own = metadata.get("max_response_len")
        budget = budget_flag if not isinstance(own, int) else min(budget_flag, own)
        reason = _drop_reason(row[input_key], tokens, budget, max_len, context)
        if reason is not None:
            dropped[i] = f"{reason} ({where}, key {input_key!r})"
            if len(dropped) <= MAX_LOGGED_DROPS:
                logger.warning("%s: dropped (%s): %s", where, reason_category(reason), reason.split(": ", 1)[1])
            entries.append(None)
            continue
        metadata["row"] = i
        label = row[label_key] if label_key is not None else None
        entries.append(PromptEntry(row=i, prompt=text, tokens=tokens, label=label, metadata=metadata))
    if dropped:
        logger.warning("%s: dropped %d of %d rows (%s)%s", path, len(dropped), len(entries),
                       drop_counts_text(dropped),
                       f"; only the first {MAX_LOGGED_DROPS} are listed" if len(dropped) > MAX_LOGGED_DROPS else "")
    return entries, dropped


def drop_counts(dropped: dict[int, str]) -> Counter:
    """Dropped rows by category (`empty_prompt`, `over_max_prompt_len`, `over_context_length`)."""
    return Counter(reason_category(r) for r in dropped.values())


def drop_counts_text(dropped: dict[int, str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(drop_counts(dropped).items()))


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
    """Fresh prompt groups, epoch after epoch, with exact resume (shuffled: epoch e's seed --rollout-seed + e)."""

    def __init__(self, args, tokenizer):
        self.args = args
        self.path = args.prompt_data
        # dropped: 0-based row -> reason, for the ledger (RolloutManager records them in the buffer's)
        self.rows, self.dropped = prepare_entries(args, tokenizer, self.path)
        self.entries = [e for e in self.rows if e is not None]
        if not self.entries:
            raise DataError(
                f"--prompt-data {self.path}: no usable prompts"
                + (f" (all {len(self.rows)} rows dropped: {drop_counts_text(self.dropped)})" if self.rows else "")
            )
        self.n_samples_per_prompt = args.n_samples_per_prompt
        self.shuffle = args.rollout_shuffle
        self.seed = args.rollout_seed
        self.epoch = 0
        self.offset = 0  # position in the current epoch's order of file rows
        self.group_counter = 0
        self.sample_counter = 0
        self._order = self._order_for(0)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def dropped_rows(self) -> Counter:
        """Rows dropped at load, by reason category."""
        return drop_counts(self.dropped)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_groups(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` fresh groups of `--n-samples-per-prompt` PENDING samples each."""
        if num_groups < 0:
            raise ValueError(f"get_groups: num_groups must be >= 0, got {num_groups}")
        n = self.n_samples_per_prompt
        groups = []
        while len(groups) < num_groups:
            if self.offset >= len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._order_for(self.epoch)
                logger.info("data source %s: starting epoch %d", self.path, self.epoch)
            entry = self.rows[self._order[self.offset]]
            self.offset += 1
            if entry is None:  # dropped at load: its place in the order stays, it is never drawn
                continue
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
            "num_rows": len(self.rows),
            "num_prompts": len(self.entries),
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "offset", "group_counter", "sample_counter"} - set(state)
        if missing:
            raise DataError(f"data source state is missing {sorted(missing)}")
        if "num_rows" in state:
            if state["num_rows"] != len(self.rows):
                raise DataError(
                    f"data source state was saved with {state['num_rows']} rows but --prompt-data {self.path} now "
                    f"has {len(self.rows)}: the resumed order would not match"
                )
            if state.get("num_prompts", len(self.entries)) != len(self.entries):
                logger.warning("data source: %d usable prompts at save, %d now (rows dropped differently); the "
                               "position is in file rows, so the order is unchanged", state["num_prompts"],
                               len(self.entries))
        elif state.get("num_prompts", len(self.entries)) != len(self.entries) or len(self.entries) != len(self.rows):
            # a state from before positions counted file rows: its offset counts usable prompts only
            raise DataError(
                f"data source state was saved with {state.get('num_prompts')} prompts but --prompt-data {self.path} "
                f"now yields {len(self.entries)} of {len(self.rows)} rows: the resumed order would not match"
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
    """Every prompt of an eval set as a group of `n_samples` samples, in file order, with negative ids."""
    if n_samples < 1:
        raise DataError(f"eval set {name!r}: n_samples must be >= 1, got {n_samples}")
    rows, dropped = prepare_entries(args, tokenizer, path, flag=f"eval set {name!r}",
                                    response_budget=args.eval_max_response_len)
    if dropped:
        logger.warning("eval set %r: %d prompts were left out (%s)", name, len(dropped), drop_counts_text(dropped))
    groups = []
    for g, entry in enumerate(e for e in rows if e is not None):
        groups.append(_make_group(entry, -(g + 1), -(g * n_samples + 1), n_samples, step=-1, extra={"eval_name": name}))
    return groups
