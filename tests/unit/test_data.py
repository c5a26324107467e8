"""The dataset pipeline: tokenize-once cache (also across ranks), parallel tokenization, mixing, eval split,
over-long policy, clear errors for bad input, and the `zerotune preprocess` command (CPU, no network)."""

import json
import multiprocessing
import os
import re
import shutil
from collections import Counter

import numpy as np
import pytest

import finetune.data.cache as data_module
from finetune.config import ConfigError, DataConfig, load_recipe
from finetune.data import build_datasets
from finetune.data.tokenizer import load_tokenizer
from finetune.commands.preprocess import main as preprocess
from tests.fixtures.data_files import TINY_INSTRUCT, write_lines
from tests.helpers import ROOT, TINY_RECIPE

CHAT = os.path.join(ROOT, "recipes", "data", "sample_chat.jsonl")  # 400 messages records
EVAL = os.path.join(ROOT, "tests", "fixtures", "data", "eval_alpaca.jsonl")  # 7 alpaca records


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-common")


def samples(data) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(data.sample(i)[0].tolist()), tuple(data.sample(i)[1].tolist())) for i in range(len(data))]


def same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "labels", "offsets"))


# --- 3. tokenize once ---------------------------------------------------------------------------------

@pytest.fixture
def tokenize_calls(monkeypatch):
    """Counts calls of tokenize_file (what load_or_tokenize runs to build a cache entry)."""
    calls = []
    original = data_module.tokenize_file

    def counting(path, *args, **kwargs):
        calls.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(data_module, "tokenize_file", counting)
    return calls


def test_cache_is_built_once_and_reused(tok, tmp_path, tokenize_calls, monkeypatch):
    cfg = DataConfig(path=TINY_INSTRUCT, format="alpaca", max_seq_len=256)
    first, _, report = build_datasets(cfg, tok, 42, str(tmp_path))
    assert tokenize_calls == [TINY_INSTRUCT] and report.built_cache

    encodes = []
    monkeypatch.setattr(tok, "encode", lambda text: encodes.append(text) or [])
    second, _, report = build_datasets(cfg, tok, 42, str(tmp_path))
    assert tokenize_calls == [TINY_INSTRUCT] and encodes == [] and not report.built_cache
    assert same(first, second) and report.samples == 40


def test_changed_data_file_rebuilds_the_cache(tok, tmp_path, tokenize_calls):
    path = tmp_path / "data.jsonl"
    shutil.copy(TINY_INSTRUCT, path)
    cfg = DataConfig(path=str(path), format="alpaca", max_seq_len=256)
    before, _, _ = build_datasets(cfg, tok, 42, str(tmp_path / "cache"))
    text = path.read_text()
    path.write_text(text.replace("ZeRO stage 1 partitions", "ZeRO stage 1 partitionz"))  # same size, new content
    after, _, report = build_datasets(cfg, tok, 42, str(tmp_path / "cache"))
    assert len(tokenize_calls) == 2 and report.built_cache and not same(before, after)
    # A setting that changes the tokens is part of the key too.
    build_datasets(DataConfig(path=str(path), format="alpaca", max_seq_len=128), tok, 42, str(tmp_path / "cache"))
    assert len(tokenize_calls) == 3


# --- 4. parallel tokenization -------------------------------------------------------------------------

@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_num_proc_gives_identical_results(tok, tmp_path, monkeypatch, overlong):
    monkeypatch.setattr(data_module, "CHUNK_RECORDS", 37)  # 11 chunks: several per worker, out-of-order completion
    results = []
    for num_proc in (1, 2):
        cfg = DataConfig(path=CHAT, format="messages", max_seq_len=160, overlong=overlong, num_proc=num_proc)
        results.append(build_datasets(cfg, tok, 42, str(tmp_path / f"cache{num_proc}")))
    (a, _, ra), (b, _, rb) = results
    assert same(a, b)
    assert (ra.samples, ra.dropped_overlong, ra.truncated, ra.dropped_no_target) == \
           (rb.samples, rb.dropped_overlong, rb.truncated, rb.dropped_no_target)
    assert ra.dropped_overlong + ra.truncated > 0  # the policy was exercised


def test_worker_errors_name_file_and_line(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "CHUNK_RECORDS", 4)
    good = '{"instruction": "Hi", "output": "Hello"}'
    lines = [good] * 9 + ['{"instruction": "Hi", "output": 3}'] + [good] * 5 + ['{"instruction": "Hi"'] + [good] * 3
    path = write_lines(tmp_path / "bad.jsonl", lines)
    for num_proc in (1, 2):
        with pytest.raises(ConfigError) as e:
            build_datasets(DataConfig(path=path, num_proc=num_proc), tok, 42, str(tmp_path / f"c{num_proc}"))
        assert str(e.value).startswith(f"{path}:10: field 'output' must be string, got integer")
        assert multiprocessing.active_children() == []  # the workers finished their chunks and exited, none killed
    lines[9] = good
    path = write_lines(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ConfigError, match=re.escape(f"{path}:16: the line is cut short")):
        build_datasets(DataConfig(path=path, num_proc=2), tok, 42, str(tmp_path / "c3"))
    assert multiprocessing.active_children() == []


# --- 5. mixing ----------------------------------------------------------------------------------------

def test_mix_weights_counts_and_determinism(tok, tmp_path):
    cfg = DataConfig(path=TINY_INSTRUCT, format="alpaca", max_seq_len=512,
                     mix=[f"{EVAL}:2.5", f"{CHAT}:0.1:messages", f"{EVAL}"])
    train, _, report = build_datasets(cfg, tok, 42, str(tmp_path))
    used = [s["used"] for s in report.sources]
    assert used == [40, 18, 40, 7]  # 40 x 1, round(7 x 2.5) = 17.5 -> 18, 400 x 0.1, 7 x 1
    assert len(train) == report.samples == sum(used)
    assert [s["format"] for s in report.sources] == ["alpaca", "alpaca", "messages", "alpaca"]

    parts = np.cumsum([0] + used)
    part = lambda k: Counter(samples(train)[parts[k]:parts[k + 1]])
    eval_alone, _, _ = build_datasets(DataConfig(path=EVAL, max_seq_len=512), tok, 42, str(tmp_path))
    chat_alone, _, _ = build_datasets(DataConfig(path=CHAT, format="messages", max_seq_len=512), tok, 42, str(tmp_path))
    # Weight 2.5: every sample twice, and 4 of the 7 a third time.
    assert sorted(part(1)[s] for s in samples(eval_alone)) == [2, 2, 2, 3, 3, 3, 3]
    assert sum(part(2).values()) == 40 and set(part(2)) <= set(samples(chat_alone))
    assert part(3) == Counter(samples(eval_alone))

    again, _, _ = build_datasets(cfg, tok, 42, str(tmp_path))
    other, _, _ = build_datasets(cfg, tok, 7, str(tmp_path))
    assert same(train, again)  # deterministic given train.seed
    assert not same(train, other) and len(other) == len(train)  # another seed picks another subset


@pytest.mark.parametrize("entry,message", [
    ("{EVAL}:abc", "data.mix[0] '{EVAL}:abc': weight 'abc' is not a number; write PATH, PATH:WEIGHT or PATH:WEIGHT:FORMAT"),
    ("{EVAL}:0", "data.mix[0] '{EVAL}:0': weight must be a number > 0"),
    ("{EVAL}:-1", "weight must be a number > 0"),
    ("{EVAL}:nan", "weight must be a number > 0"),
    ("{EVAL}:1:alpaca:x", "data.mix[0] '{EVAL}:1:alpaca:x': write PATH, PATH:WEIGHT or PATH:WEIGHT:FORMAT"),
    (":2", "data.mix[0] ':2': write PATH"),
    ("{EVAL}:1:", "data.mix[0] '{EVAL}:1:': empty format"),
    ("nope.jsonl:2", "data.mix[0] 'nope.jsonl:2': data file 'nope.jsonl' not found"),
    ("{EVAL}:1:nope", "data.mix[0] '{EVAL}:1:nope': unknown dataset format 'nope'; known formats: alpaca,"),
])
def test_mix_entry_errors_name_the_entry(tok, tmp_path, entry, message):
    cfg = DataConfig(path=TINY_INSTRUCT, mix=[entry.format(EVAL=EVAL)])
    with pytest.raises(ConfigError) as e:
        build_datasets(cfg, tok, 42, str(tmp_path))
    assert message.format(EVAL=EVAL) in str(e.value)


def test_mix_from_the_command_line():
    recipe = load_recipe(TINY_RECIPE, ["data.mix=a.jsonl:0.5,b.jsonl:2:sharegpt", "data.num_proc=4"])
    assert recipe.data.mix == ["a.jsonl:0.5", "b.jsonl:2:sharegpt"] and recipe.data.num_proc == 4


# --- eval split ---------------------------------------------------------------------------------------

def test_eval_fraction_holds_out_before_mixing(tok, tmp_path):
    cfg = DataConfig(path=TINY_INSTRUCT, format="alpaca", max_seq_len=512, eval_fraction=0.1, mix=[f"{EVAL}:3"])
    train, evaluation, report = build_datasets(cfg, tok, 42, str(tmp_path))
    assert report.eval_samples == len(evaluation) == 4 + 1  # round(0.1 x 40) + max(1, round(0.1 x 7))
    assert [s["samples"] for s in report.sources] == [36, 6] and len(train) == 36 + 3 * 6
    assert not set(samples(evaluation)) & set(samples(train))  # no copy of an eval sample is trained on
    everything = Counter(samples(build_datasets(DataConfig(path=TINY_INSTRUCT, max_seq_len=512), tok, 42, str(tmp_path))[0]))
    assert Counter(samples(train)[:36]) + Counter(samples(evaluation)[:4]) == everything
    again = build_datasets(cfg, tok, 42, str(tmp_path))
    assert same(train, again[0]) and same(evaluation, again[1])


# --- 6. bad input: a ConfigError that says what and where, before any model exists ---------------------

BAD_INPUTS = [
    # (file name, lines, overrides, message parts)
    ("bad.jsonl", ['{"instruction": "a", "output": "b"}', '{"instruction": "a", "output": "b"'], {},
     ["{path}:2: the line is cut short", "complete the record or remove that line"]),
    ("bad.jsonl", ['{"instruction": "a", "output": "b"}'] * 2 + ['{"instruction": "a"}'], {},
     ["{path}:3: missing field 'output'; format 'alpaca' expects {{instruction, input?, output}}"]),
    ("bad.json", ['[{"instruction": "a", "output": "b"}, {"instruction": "a"}]'], {},
     ["{path} record 1: missing field 'output'; format 'alpaca' expects"]),
    ("bad.jsonl", ['{"instruction": "a", "output": ["b"]}'], {},
     ["{path}:1: field 'output' must be string, got array; format 'alpaca' expects"]),
    ("bad.jsonl", ['{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 2}]}'],
     {"format": "messages"}, ["{path}:1: field 'messages[1].content' must be string, got integer"]),
    ("bad.jsonl", ['["not", "an", "object"]'], {}, ["{path}:1: each line must be a JSON object, got list"]),
    ("empty.jsonl", ["", "  "], {}, ["{path}: the dataset is empty: no records found"]),
    ("long.jsonl", ['{"instruction": "a b c d e f", "output": "g h i j k"}'] * 3, {"max_seq_len": 8},
     ["{path}: all 3 records were dropped (3 longer than data.max_seq_len=8, 0 with no trained tokens)",
      "set data.overlong=truncate"]),
    ("masked.jsonl", ['{"instruction": "a b c d e f g h", "output": "i"}'] * 2, {"max_seq_len": 8, "overlong": "truncate"},
     ["{path}: all 2 records were dropped (0 longer than data.max_seq_len=8, 2 with no trained tokens)"]),
    ("ok.jsonl", ['{"instruction": "a", "output": "b"}'], {"format": "nope"},
     ["data.format: unknown dataset format 'nope'; known formats: alpaca, instruction_output, interactions,"]),
    ("ok.jsonl", ['{"instruction": "a", "output": "b"}'], {"plugins": ["tests.fixtures.plugins.does_not_exist"]},
     ["cannot import dataset-format plugin module 'tests.fixtures.plugins.does_not_exist'", "`data.plugins`"]),
    ("ok.jsonl", ['{"instruction": "a", "output": "b"}'], {"eval_path": "missing.jsonl"},
     ["data.eval_path: data file 'missing.jsonl' not found"]),
]


@pytest.mark.parametrize("name,lines,overrides,parts", BAD_INPUTS, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD_INPUTS)])
def test_bad_input_is_a_config_error_naming_the_place(tok, tmp_path, name, lines, overrides, parts):
    path = write_lines(tmp_path / name, lines)
    with pytest.raises(ConfigError) as e:
        build_datasets(DataConfig(path=path, **overrides), tok, 42, str(tmp_path / "cache"))
    for part in parts:
        assert part.format(path=path) in str(e.value)


def test_preprocess_prints_the_error_and_exits_2(tmp_path, capsys):
    path = write_lines(tmp_path / "bad.jsonl", ['{"instruction": "a"}'])
    assert preprocess(["--config", TINY_RECIPE, "--cache-dir", str(tmp_path), f"data.path={path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerotune: error: {path}:1: missing field 'output'") and "Traceback" not in err


# --- 7. over-long policy ------------------------------------------------------------------------------

def test_overlong_drop_vs_truncate(tok, tmp_path):
    full, _, _ = build_datasets(DataConfig(path=CHAT, format="messages", max_seq_len=4096), tok, 42, str(tmp_path))
    long = full.lengths > 128
    assert 0 < long.sum() < len(full)

    dropped, _, report = build_datasets(DataConfig(path=CHAT, format="messages", max_seq_len=128), tok, 42, str(tmp_path))
    assert report.dropped_overlong == long.sum() and report.truncated == 0 and len(dropped) == (~long).sum()
    assert samples(dropped) == [s for s, is_long in zip(samples(full), long) if not is_long]

    cut, _, report = build_datasets(DataConfig(path=CHAT, format="messages", max_seq_len=128, overlong="truncate"),
                                    tok, 42, str(tmp_path))
    assert report.truncated == long.sum() and report.dropped_overlong == 0
    assert len(cut) == len(full) - report.dropped_no_target and cut.lengths.max() == 128
    # A truncated sample is the first 128 tokens of the original; the others are untouched.
    expected = [(ids[:128], labels[:128]) for ids, labels in samples(full)
                if any(label != -100 for label in labels[1:128])]
    assert samples(cut) == expected


# --- 9. zerotune preprocess ---------------------------------------------------------------------------

def test_preprocess_reports_shows_and_dumps(tmp_path, capsys):
    dump = tmp_path / "dump.jsonl"
    args = ["--config", TINY_RECIPE, "--cache-dir", str(tmp_path / "cache"), "--show", "2", "--dump", str(dump),
            "data.max_seq_len=32", f"data.mix={EVAL}:2"]
    assert preprocess(args) == 0
    out = capsys.readouterr().out
    counts = re.search(r"^(\d+) training samples, ([\d,]+) tokens \(([\d,]+) trained\), 0 eval samples; "
                       r"dropped (\d+) over-long and 0 with nothing to train, truncated 0", out, re.M)
    assert counts, out
    n, dropped = int(counts.group(1)), int(counts.group(4))
    assert dropped > 0 and n > 0  # 32 tokens is shorter than some of the bundled samples
    assert re.search(r"^\d+ rows of 32 tokens per epoch, pack fill \d+\.\d%$", out, re.M)
    assert re.search(r"^tokenized [\d,]+ tokens in [\d.]+ s on 1 process \([\d,]+ tokens/s\)", out, re.M), out
    shown = out.split("--- sample ")[1:]
    assert len(shown) == 2 and shown[0].startswith("0\n<s>[INST] ") and "[[" in shown[0] and "</s>]]" in shown[0]

    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    assert len(rows) == n and f"wrote {n} samples to {dump}" in out
    assert all(len(r["input_ids"]) == len(r["labels"]) <= 32 for r in rows)

    assert preprocess(args) == 0  # the second run reads the cache
    assert "read from the cache" in capsys.readouterr().out


def test_pack_fill_without_packing_is_against_the_longest_pair_of_paired_data():
    """A row of paired data without packing holds a whole pair, so its width is the longest pair's, not the longest
    sequence's (which put the fill over 100%)."""
    from finetune.commands.preprocess import pack_fill
    from finetune.data.samples import TokenizedData

    seqs = [([1] * n, [-100] + [1] * (n - 1)) for n in (10, 30, 25, 25)]  # pairs of 40 and 50 tokens; 90 in all
    pairs, singles = TokenizedData.from_samples(seqs, paired=True), TokenizedData.from_samples(seqs)
    assert pack_fill(pairs, 64, packing=False) == (2, 90 / (2 * 50))  # was 90 / (2 * 30): 150%
    assert pack_fill(singles, 64, packing=False) == (4, 90 / (4 * 30))
    assert pack_fill(pairs, 64, packing=True) == (2, 90 / (2 * 64))  # 40 + 50 > 64: a pair per row, whole


def test_preprocess_reports_pairs_per_row_without_packing(tmp_path, capsys):
    args = ["--config", "tiny_dpo", "--cache-dir", str(tmp_path), "data.packing=false"]
    assert preprocess(args) == 0
    out = capsys.readouterr().out
    recipe = load_recipe("tiny_dpo", ["data.packing=false"])
    data, _, _ = build_datasets(recipe.data, load_tokenizer(recipe.model.tokenizer), recipe.train.seed,
                                str(tmp_path))
    pair_lengths = data.lengths[0::2] + data.lengths[1::2]
    assert pair_lengths.max() > data.lengths.max()  # the longest pair is wider than the longest sequence
    expected = 100 * data.lengths.sum() / (len(pair_lengths) * pair_lengths.max())
    assert re.search(rf"^{len(pair_lengths)} rows per epoch \(data.packing=false: one pair per row\), pack fill "
                     rf"{expected:.1f}% of rows as long as the longest pair$", out, re.M), out
