"""Read records from local files: JSON/JSONL (with line numbers in errors), Parquet/CSV/Arrow and `save_to_disk` folders.

    for where, raw in read_raw("data/train.jsonl"): record = parse_raw(where, raw)
    sources = parse_mix(["extra.jsonl:0.5", "chat.jsonl:2:messages"], default_format="alpaca")

Our own JSON reader names the file and line of a malformed record; the other formats go through `datasets`.
JSONL lines are handed out unparsed by `read_raw`, so tokenizer workers parse them in parallel (`parse_raw`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from finetune.config import ConfigError

DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_MIX_SYNTAX = "write PATH, PATH:WEIGHT or PATH:WEIGHT:FORMAT (e.g. extra.jsonl:0.5:sharegpt)"


@dataclass(frozen=True)
class Source:
    """One data file of a recipe, with its mixing weight and format; `entry` names it in error messages."""

    path: str
    weight: float
    format: str
    entry: str


def parse_mix(entries: list[str], default_format: str) -> list[Source]:
    """`data.mix` entries -> Sources; a bad entry raises ConfigError naming it and the expected syntax."""
    sources = []
    for i, entry in enumerate(entries):
        name = f"data.mix[{i}] {entry!r}"
        parts = entry.split(":")
        if len(parts) > 3 or not parts[0].strip():
            raise ConfigError(f"{name}: {_MIX_SYNTAX}")
        path, weight, fmt = parts[0].strip(), 1.0, default_format
        if len(parts) >= 2:
            try:
                weight = float(parts[1])
            except ValueError:
                raise ConfigError(f"{name}: weight {parts[1]!r} is not a number; {_MIX_SYNTAX}") from None
            if not math.isfinite(weight) or weight <= 0:
                raise ConfigError(f"{name}: weight must be a number > 0, got {parts[1]!r} (drop the entry to leave it out)")
        if len(parts) == 3:
            fmt = parts[2].strip()
            if not fmt:
                raise ConfigError(f"{name}: empty format; {_MIX_SYNTAX}")
        if not os.path.exists(path):
            raise ConfigError(f"{name}: data file {path!r} not found")
        sources.append(Source(path, weight, fmt, name))
    return sources


def read_raw(path: str) -> Iterator[tuple[str, str | dict[str, Any]]]:
    """Yield (where, raw): a JSONL line's text still to parse with `parse_raw`, or an already-read record; `where`
    names the file and line or row for error messages."""
    if not os.path.exists(path):
        raise ConfigError(f"data file {path!r} not found: set data.path (or data.eval_path) to a local file or folder")
    if os.path.isdir(path):
        yield from _read_with_datasets(path, None)
        return
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        yield from _read_jsonl_lines(path)
    elif ext == ".json":
        yield from _read_json(path)
    elif ext in DATASETS_BUILDERS:
        yield from _read_with_datasets(path, DATASETS_BUILDERS[ext])
    else:
        raise ConfigError(f"{path}: unknown data file type {ext!r}: use .jsonl, .json, .parquet, .csv, .arrow or a save_to_disk folder")


def parse_raw(where: str, raw: str | dict[str, Any]) -> dict[str, Any]:
    """The record of a `read_raw` pair; a malformed JSONL line raises ConfigError naming file and line."""
    if not isinstance(raw, str):
        return raw
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: malformed JSON ({e.msg} at column {e.colno}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
    return record


def _read_jsonl_lines(path: str) -> Iterator[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield f"{path}:{lineno}", line


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
    import datasets  # lazy: slow to import (pyarrow, pandas); JSON sources and the tokenizer workers never need it

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
