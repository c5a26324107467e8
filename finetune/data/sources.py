"""Read records from local files: JSON/JSONL and text (with line numbers in errors), Parquet/CSV/Arrow and
`save_to_disk` folders.

    for where, raw in read_raw("data/train.jsonl"): record = parse_raw(where, raw)
    sources = parse_mix(["extra.jsonl:0.5", "chat.jsonl:2:messages"], default_format="alpaca")

Our own JSON and text readers name the file and line of a malformed record (and the line and column of a byte that
is not UTF-8) and accept a UTF-8 byte-order mark; the other formats go through `datasets`. JSONL lines are handed
out unparsed by `read_raw`, so tokenizer workers parse them in parallel (`parse_raw`). A mistake in the data is a
DataError.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from finetune.config import ConfigError

DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
READABLE = ("JSONL (.jsonl, one object per line), JSON (.json, one list of objects), Parquet (.parquet), CSV (.csv), "
            "Arrow (.arrow) or text (.txt, one {\"text\": line} record per line) files, or a folder written by "
            "datasets' save_to_disk")
_MIX_SYNTAX = "write PATH, PATH:WEIGHT or PATH:WEIGHT:FORMAT (e.g. extra.jsonl:0.5:sharegpt)"


class DataError(ConfigError):
    """A mistake in the data itself, found while reading or tokenizing it: the message names the file, the line (or
    record, or row) and what to fix. A ConfigError, so whatever answers a recipe mistake answers this one too."""


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
        _check_saved_dataset(path)
        yield from _read_with_datasets(path, None)
        return
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        yield from _read_jsonl_lines(path)
    elif ext == ".json":
        yield from _read_json(path)
    elif ext == ".txt":
        yield from _read_text_lines(path)
    elif ext in DATASETS_BUILDERS:
        yield from _read_with_datasets(path, DATASETS_BUILDERS[ext])
    else:
        raise DataError(f"{path}: unknown data file type {ext!r}: zerotune reads {READABLE}")


def parse_raw(where: str, raw: str | dict[str, Any]) -> dict[str, Any]:
    """The record of a `read_raw` pair; a malformed JSONL line raises DataError naming file and line."""
    if not isinstance(raw, str):
        return raw
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        text = raw.rstrip(_JSON_SPACE)
        if _cut_short(text):
            raise DataError(f"{where}: the line is cut short: its JSON record stops at column {len(text)} before it "
                            f"is complete (a file truncated mid-record?); complete the record or remove that line"
                            ) from None
        # The column within the line, counted from 1.
        raise DataError(f"{where}: malformed JSON ({_what(e, e.pos + 1)}); fix or remove that line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: each line must be a JSON object, got {type(record).__name__}")
    return record


_JSON_SPACE = " \t\r\n"  # the whitespace JSON allows between values (str.rstrip() drops more)
# What is left of a JSON value that the end of the text cut: a literal's first letters (tr, fals, nu), a lone minus
# sign, or a number's decimal point or exponent (json stops before them: "1." fails at the ".").
_CUT_VALUE = re.compile(r"t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|-|\.|[eE][+-]?")
_CUT_ESCAPE = re.compile(r"u[0-9a-fA-F]{0,4}")  # a \uXXXX escape the end cut (json wants a character after it)


def _cut_short(text: str) -> bool:
    """Whether JSON `text` (its trailing whitespace dropped, so that a line end after the cut does not count as a
    character inside a string) fails only because it ends too soon, i.e. it is the start of a valid JSON value: the
    decoder stops at its very end, inside a string that never closes, or in a value or escape that the end cut
    (`{"a": tr`, `{"a": 1.`, a string's escape cut after its u)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        tail = text[e.pos:]
        return (e.pos >= len(text) or e.msg.startswith("Unterminated string") or _CUT_VALUE.fullmatch(tail) is not None
                or (e.msg.startswith("Invalid \\uXXXX") and _CUT_ESCAPE.fullmatch(tail) is not None))
    return False


def _what(e: json.JSONDecodeError, column: int) -> str:
    """json's own words for the error and where, e.g. 'Invalid control character at column 12': its message already
    ends in "at" for some errors ("Invalid control character at"), which is not said twice."""
    return f"{e.msg.removesuffix(' at')} at column {column}"


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line of a UTF-8 file, a byte-order mark dropped; a byte that is not UTF-8 raises
    DataError naming its line and column."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            yield from enumerate(f, start=1)
    except UnicodeDecodeError:
        raise _not_utf8(path) from None


def _not_utf8(path: str) -> DataError:
    """The first byte of `path` that is not UTF-8, as FILE:LINE:COLUMN (the column counts characters, from 1).
    UTF-8 never uses the newline byte inside a character, so the file splits into lines before decoding."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                column = len(line[:e.start].decode("utf-8").removeprefix("\ufeff")) + 1
                if lineno == 1 and line[:2] in (b"\xff\xfe", b"\xfe\xff"):  # UTF-16's byte-order marks
                    fix = "the file is UTF-16: save it as UTF-8 (iconv -f utf-16 -t utf-8 IN > OUT)"
                else:
                    fix = "save the file as UTF-8 (from Latin-1: iconv -f latin1 -t utf-8 IN > OUT)"
                return DataError(f"{path}:{lineno}:{column}: byte 0x{line[e.start]:02x} is not UTF-8 ({e.reason}); "
                                 f"{fix}")
    return DataError(f"{path}: not UTF-8: save the file as UTF-8")


def _renamed(path: str, ext: str) -> str:
    return os.path.splitext(path)[0] + ext


def _read_jsonl_lines(path: str) -> Iterator[tuple[str, str]]:
    first = True
    for lineno, line in _lines(path):
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):
            raise DataError(f"{path}:{lineno}: each line must be a JSON object, got list (a JSON array): a file that "
                            f"holds one JSON array of records is JSON, not JSON Lines; rename it to "
                            f"{_renamed(path, '.json')}, or write one object per line")
        first = False
        yield f"{path}:{lineno}", line


def _read_text_lines(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """One {"text": line} record per non-blank line (as `datasets`' text reader), for data.format=text."""
    for lineno, line in _lines(path):
        if line.strip():
            yield f"{path}:{lineno}", {"text": line.rstrip("\n")}


def _read_json(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise _not_utf8(path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        body = text.rstrip(_JSON_SPACE)
        if _cut_short(body):
            raise DataError(f"{path}:{body.count(chr(10)) + 1}: the file is cut short: its JSON stops on this line "
                            f"before it is complete (a file truncated mid-record?); restore the rest of the file or "
                            f"write it again") from None
        fix = "fix the JSON there"
        if e.msg == "Extra data" and text.lstrip().startswith("{"):
            fix = f"the file holds one JSON object per line, which is JSON Lines: rename it to {_renamed(path, '.jsonl')}"
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({_what(e, e.colno)}); {fix}") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: a .json data file must hold a list of records (or use .jsonl, one record per line)")
    for i, record in enumerate(data):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} must be a JSON object, got {type(record).__name__}")
        yield f"{path} record {i}", record


def _check_saved_dataset(path: str) -> None:
    """A folder is read only as `datasets`' save_to_disk wrote it: a Dataset (dataset_info.json and state.json) or a
    DatasetDict (dataset_dict.json), the files load_from_disk looks for."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(path, name))

    if (has("dataset_info.json") and has("state.json")) or has("dataset_dict.json"):
        return
    readable = (".jsonl", ".json", ".txt", *DATASETS_BUILDERS)
    found = sorted(name for name in os.listdir(path) if os.path.splitext(name)[1].lower() in readable)
    hint = (f"; it holds {', '.join(found[:3])}{', ...' if len(found) > 3 else ''}: set data.path to one of them "
            f"(and data.mix to the others)" if found else "")
    raise DataError(f"{path}: this folder is not a dataset saved by datasets' save_to_disk (no state.json or "
                    f"dataset_dict.json){hint}. zerotune reads {READABLE}")


def _read_with_datasets(path: str, builder: str | None) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets  # lazy: slow to import (pyarrow, pandas); JSON sources and the tokenizer workers never need it

    if builder is None:
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict needs a 'train' split, found {list(ds)}")
            ds = ds["train"]
    else:
        try:
            ds = datasets.load_dataset(builder, data_files=path, split="train")
        except datasets.exceptions.DatasetGenerationError as e:
            cause = e.__cause__ or e
            if isinstance(cause, UnicodeDecodeError):
                raise _not_utf8(path) from None
            raise DataError(f"{path}: not a readable {builder} file ({type(cause).__name__}: {cause}); fix the file "
                            f"or write it again") from None
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
