"""A dataset file's rows (`read_rows`): `.jsonl` (read with `json`: HF `datasets` rejects blank lines and names no
row), `.json` and `.parquet`. Every row error (`DataError`) names the file, the 1-based row, and what is wrong."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from slime.utils.safe_load import CheckpointFileError, read_json_file


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file, row and key."""


def _text_lines(path: str):
    """(line number, line) of a UTF-8 text file; a binary file is named as one, not a UnicodeDecodeError."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if b"\x00" in raw:
                raise DataError(f"{path}: line {lineno} holds NUL bytes: a binary file, not JSON lines")
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {lineno} is not UTF-8 text (byte {e.start}: {e.reason}); "
                                "a binary or differently encoded file?") from None


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    rows = []
    for lineno, line in _text_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: line {lineno}: invalid JSON: {e.msg} at column {e.colno}") from e
        rows.append((f"line {lineno}", obj))
    return rows


def _read_parquet(path: str) -> list[tuple[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    with tempfile.TemporaryDirectory(prefix="slime-datasets-") as cache_dir:
        ds = datasets.load_dataset("parquet", data_files=path, split="train", cache_dir=cache_dir, keep_in_memory=True)
        return [(f"row {i + 1}", row) for i, row in enumerate(ds.to_list())]


def read_rows(path: str, flag: str = "--prompt-data") -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every row of a local `.jsonl` / `.json` / `.parquet` file, the row a dict and where it is
    `line N` (JSON lines) or `row N` (a JSON array, parquet), 1-based; errors name the file and the line."""
    if not path:
        raise DataError(f"{flag} is not set")
    if not os.path.isfile(path):
        raise DataError(f"{flag} file not found: {path}")
    if path.endswith(".parquet"):
        items = _read_parquet(path)
    elif path.endswith(".jsonl"):
        items = _read_jsonl(path)
    elif path.endswith(".json"):
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if head.startswith(b"["):
            try:
                items = [(f"row {i + 1}", obj) for i, obj in enumerate(read_json_file(path))]
            except CheckpointFileError as e:
                raise DataError(f"{path}: {e.cause}") from None
        else:
            items = _read_jsonl(path)
    else:
        raise DataError(f"{flag} {path}: unsupported file type (expected .jsonl, .json or .parquet)")
    for where, obj in items:
        if not isinstance(obj, dict):
            raise DataError(f"{path}: {where}: expected a JSON object, got {type(obj).__name__}")
    return items
