"""What the data readers tolerate and how they name what they cannot read (finetune/data/sources.py): a UTF-8
byte-order mark, bytes that are not UTF-8 (file:line:column), a JSON array saved as .jsonl and JSON Lines saved as
.json, plain text, folders that are not a saved dataset; and that a data error leaves the run's cache as it was
(finetune/train.py `_load_data`). Its integration half, through the real launcher on 2 ranks:
tests/integration/test_data_errors.py."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from finetune.config import DataConfig, load_recipe
from finetune.data import DataError, build_datasets
from finetune.data.sources import READABLE, parse_raw, read_raw
from finetune.data.tokenizer import load_tokenizer
from finetune.prepare import Run
from finetune.train import _load_data
from tests.helpers import TINY_RECIPE

RECORDS = [{"instruction": "Say hi.", "output": "Hi!"}, {"instruction": "Nämn en frukt.", "output": "Äpple."}]
BOM = b"\xef\xbb\xbf"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-common")


def records(path: str) -> list[dict]:
    return [parse_raw(where, raw) for where, raw in read_raw(path)]


def tokens(data) -> tuple[list[int], list[int]]:
    return np.asarray(data.input_ids).tolist(), np.asarray(data.labels).tolist()


def encodings(tmp_path, name: str, content: bytes) -> tuple[str, str]:
    """The same content as NAME (plain UTF-8) and bom-NAME (with a byte-order mark)."""
    plain, marked = tmp_path / name, tmp_path / f"bom-{name}"
    plain.write_bytes(content)
    marked.write_bytes(BOM + content)
    return str(plain), str(marked)


JSONL = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in RECORDS).encode()
CONTENTS = {
    "data.jsonl": JSONL,
    "data.json": json.dumps(RECORDS, ensure_ascii=False, indent=1).encode(),
    "data.csv": ("instruction,output\n" + "".join(f"{r['instruction']},{r['output']}\n" for r in RECORDS)).encode(),
}


@pytest.mark.parametrize("name", sorted(CONTENTS))
def test_a_byte_order_mark_is_read_as_no_mark(tok, tmp_path, name):
    plain, marked = encodings(tmp_path, name, CONTENTS[name])
    assert records(marked) == records(plain) == RECORDS
    with_mark = build_datasets(DataConfig(path=marked, max_seq_len=128), tok, 0, str(tmp_path / "c1"))[0]
    without = build_datasets(DataConfig(path=plain, max_seq_len=128), tok, 0, str(tmp_path / "c2"))[0]
    assert tokens(with_mark) == tokens(without)


def test_plain_text_is_one_text_record_per_line_with_or_without_a_mark(tok, tmp_path):
    plain, marked = encodings(tmp_path, "notes.txt", "First line.\r\n\r\nSecond, with ü.\nlast without newline".encode())
    expected = [{"text": "First line."}, {"text": "Second, with ü."}, {"text": "last without newline"}]
    assert records(marked) == records(plain) == expected
    assert [where for where, _ in read_raw(plain)] == [f"{plain}:1", f"{plain}:3", f"{plain}:4"]
    data = build_datasets(DataConfig(path=marked, format="text", max_seq_len=128), tok, 0, str(tmp_path / "c"))[0]
    first = data.sample(0)[0].tolist()
    assert first == [tok.bos_id] + tok.encode("First line.") + [tok.eos_id]


@pytest.mark.parametrize("name,content,where", [
    # "Nämn" before the bad byte: the column counts characters (ä is two bytes), from 1
    ("data.jsonl", JSONL + b'{"instruction": "N\xc3\xa4mn \xff", "output": "x"}\n', ":3:23: byte 0xff"),
    ("data.jsonl", BOM + b'{"instruction": "caf\xe9", "output": "x"}\n', ":1:21: byte 0xe9"),  # Latin-1, after a mark
    ("data.json", b'[\n  {"instruction": "a",\n   "output": "b\x80"}\n]\n', ":3:16: byte 0x80"),
    ("data.txt", b"fine\nalso fine\nnot \xc3(\n", ":3:5: byte 0xc3"),
    ("data.csv", b"instruction,output\nhi,th\xffere\n", ":2:6: byte 0xff"),
])
def test_bytes_that_are_not_utf8_are_named_by_line_and_column(tmp_path, name, content, where):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        records(str(path))
    assert str(e.value).startswith(f"{path}{where} is not UTF-8"), str(e.value)
    assert "save the file as UTF-8" in str(e.value) and "position" not in str(e.value)


@pytest.mark.parametrize("line,what", [
    ('{"a" 1}', "Expecting ':' delimiter at column 6"),
    ('{"a": 1}}', "Extra data at column 9"),
    ('{"a": "x\ty"}', "Invalid control character at column 9"),  # json's "... character at" says "at" once
    ('{"a": "\\u00zz"}', "Invalid \\uXXXX escape at column 9"),
])
def test_a_malformed_line_names_the_column_within_it(tmp_path, line, what):
    path = tmp_path / "data.jsonl"
    path.write_bytes(JSONL + line.encode() + b"\r\n")
    with pytest.raises(DataError) as e:
        records(str(path))
    assert str(e.value) == f"{path}:3: malformed JSON ({what}); fix or remove that line"


# A record with every kind of JSON value in it, for cutting short anywhere.
LONG = json.dumps({"instruction": "Summarise: " + "word " * 20, "input": "", "output": "caf\u00e9 " * 8,
                   "score": -1.5e-3, "ok": True, "note": None, "tags": ["a", "b"]}, ensure_ascii=True)


@pytest.mark.parametrize("end", [b"", b"\n", b"\r\n", b"  \n"])
def test_a_line_cut_short_anywhere_says_so(tmp_path, end):
    """The last line of a file truncated mid-record, at every character of it, with or without a line end after the
    cut: always "cut short" at its file, line and last character, never json's "Invalid control character at at"."""
    path = tmp_path / "data.jsonl"
    for cut in range(1, len(LONG)):
        path.write_bytes(JSONL + LONG[:cut].encode() + end)
        with pytest.raises(DataError) as e:
            records(str(path))
        assert str(e.value) == (f"{path}:3: the line is cut short: its JSON record stops at column "
                                f"{len(LONG[:cut].rstrip())} before it is "
                                f"complete (a file truncated mid-record?); complete the record or remove that line"), cut
    path.write_bytes(JSONL + LONG.encode() + end)
    assert records(str(path))[2] == json.loads(LONG)


def test_a_json_file_cut_short_names_its_last_line(tmp_path):
    path = tmp_path / "data.json"
    text = json.dumps(RECORDS, indent=1, ensure_ascii=False)
    path.write_text(text[:text.index("Äpple") + 2])
    with pytest.raises(DataError) as e:
        records(str(path))
    line = text[:text.index("Äpple")].count("\n") + 1
    assert str(e.value) == (f"{path}:{line}: the file is cut short: its JSON stops on this line before it is complete "
                            f"(a file truncated mid-record?); restore the rest of the file or write it again")


def test_a_utf16_file_is_named_as_such(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(JSONL.decode().encode("utf-16"))
    with pytest.raises(DataError, match=r"data.jsonl:1:1: byte 0xff is not UTF-8 .*; the file is UTF-16: save it as UTF-8 \(iconv -f utf-16"):
        records(str(path))


@pytest.mark.parametrize("content", [json.dumps(RECORDS), json.dumps(RECORDS, indent=2), "\n  [\n" + JSONL.decode()])
def test_a_json_array_saved_as_jsonl_is_named_and_json_suggested(tmp_path, content):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(DataError) as e:
        records(str(path))
    line = 2 if content.startswith("\n") else 1
    assert str(e.value).startswith(f"{path}:{line}: each line must be a JSON object, got list (a JSON array)")
    assert f"rename it to {tmp_path / 'data.json'}" in str(e.value)
    (tmp_path / "data.json").write_text(json.dumps(RECORDS, indent=2))
    assert records(str(tmp_path / "data.json")) == RECORDS  # the rename the message asks for reads it


def test_json_lines_saved_as_json_is_named_and_jsonl_suggested(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(JSONL)
    with pytest.raises(DataError, match=r"data.json:2: malformed JSON \(Extra data at column 1\); the file holds one "
                                        r"JSON object per line, which is JSON Lines: rename it to .*data.jsonl"):
        records(str(path))


def test_a_folder_that_is_not_a_saved_dataset_lists_what_zerotune_reads(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as e:
        records(str(empty))
    assert str(e.value) == (f"{empty}: this folder is not a dataset saved by datasets' save_to_disk (no state.json or "
                            f"dataset_dict.json). zerotune reads {READABLE}")
    for word in ("JSONL", "JSON", "Parquet", "CSV", "Arrow", "text", "save_to_disk"):
        assert word in READABLE

    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("b.jsonl", "a.jsonl", "c.parquet", "d.csv", "README.md"):
        (shards / name).write_text("")
    with pytest.raises(DataError, match=r"shards: this folder is not a dataset saved by datasets' save_to_disk .*; it "
                                        r"holds a.jsonl, b.jsonl, c.parquet, \.\.\.: set data.path to one of them "
                                        r"\(and data.mix to the others\)"):
        records(str(shards))


def test_saved_datasets_still_load(tmp_path):
    import datasets  # lazy: slow to import; only this test of the file needs it

    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "dict"))
    assert records(str(tmp_path / "one")) == records(str(tmp_path / "dict")) == RECORDS


def test_an_unknown_suffix_lists_what_zerotune_reads(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_text("a\tb\n")
    with pytest.raises(DataError, match=r"data.tsv: unknown data file type '.tsv': zerotune reads JSONL \(.jsonl"):
        records(str(path))


def test_an_unreadable_csv_is_a_data_error(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('instruction,output\n"hi,there\n')
    with pytest.raises(DataError, match=r"data.csv: not a readable csv file \(ParserError: .*\); fix the file"):
        records(str(path))


def _run(tmp_path, *overrides: str) -> Run:
    recipe = load_recipe(TINY_RECIPE, [f"train.output_dir={tmp_path / 'run'}", "data.max_seq_len=128", *overrides])
    return Run(recipe, ds={}, model_config={})


def test_a_data_error_removes_the_cache_this_run_created(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(JSONL)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + '\n{"instruction": "x", "output": \n')
    os.makedirs(tmp_path / "run")
    # the good file is tokenized into the cache before the bad one fails
    run = _run(tmp_path, f"data.path={good}", f"data.mix=[{bad}]")
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}:2: the line is cut short: .*remove that line"):
        _load_data(run, None)
    assert os.listdir(tmp_path / "run") == []


def test_a_data_error_keeps_the_cache_entries_of_earlier_runs(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_bytes(JSONL)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps(RECORDS[1]) + "\n")
    _load_data(_run(tmp_path, f"data.path={other}"), None)  # an earlier run's entry
    cache = tmp_path / "run" / ".cache"
    earlier = {name: (cache / name).read_bytes() for name in os.listdir(cache)}
    assert earlier
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x"}\n')
    with pytest.raises(DataError, match=rf"^{re.escape(str(bad))}:1: missing field 'output'"):
        _load_data(_run(tmp_path, f"data.path={good}", f"data.mix=[{bad}]"), set(earlier))
    assert {name: (cache / name).read_bytes() for name in os.listdir(cache)} == earlier
