"""Read records from local files: JSON/JSONL (with line numbers in errors), Parquet/CSV/Arrow and `save_to_disk` folders.

    for index, record in read_records("data/train.jsonl"): ...

Our own JSON reader names the file and line of a malformed record; the other formats go through `datasets`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from finetune.config import ConfigError

DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def read_records(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield (where, record) pairs; `where` names the file and line or row for error messages."""
    if not os.path.exists(path):
        raise ConfigError(f"data file {path!r} not found: set data.path (or data.eval_path) to a local file or folder")
    if os.path.isdir(path):
        yield from _read_with_datasets(path, None)
        return
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        yield from _read_jsonl(path)
    elif ext == ".json":
        yield from _read_json(path)
    elif ext in DATASETS_BUILDERS:
        yield from _read_with_datasets(path, DATASETS_BUILDERS[ext])
    else:
        raise ConfigError(f"{path}: unknown data file type {ext!r}: use .jsonl, .json, .parquet, .csv, .arrow or a save_to_disk folder")


def _read_jsonl(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); fix or remove that line") from None
            if not isinstance(record, dict):
                raise ConfigError(f"{path}:{lineno}: each line must be a JSON object, got {type(record).__name__}")
            yield f"{path}:{lineno}", record


def _read_json(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: a .json data file must hold a list of records (or use .jsonl, one record per line)")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise ConfigError(f"{path}: record {i} must be a JSON object, got {type(record).__name__}")
        yield f"{path} record {i}", record


def _read_with_datasets(path: str, builder: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets

    if builder is None:
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ConfigError(f"{path}: a DatasetDict needs a 'train' split, found {list(ds)}")
            ds = ds["train"]
    else:
        ds = datasets.load_dataset(builder, data_files=path, split="train")
    for i, record in enumerate(ds):
        yield f"{path} row {i}", record


def file_fingerprint(path: str) -> str:
    """Content hash of a data file or folder, for cache keys: a changed file rebuilds the cache."""
    import hashlib

    h = hashlib.sha256()
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(root, name) for root, _, names in os.walk(path) for name in names
    )
    for name in files:
        h.update(os.path.relpath(name, path).encode())
        with open(name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
