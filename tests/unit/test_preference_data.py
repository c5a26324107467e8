"""Preference data: the `preference` format's three record forms against the SFT chat encoding, its record errors,
paired data through the cache, eval split, mixing and packing (pairs stay whole, chosen first), collate's
sample_index, and over-long pairs dropped whole."""

import json
import os

import numpy as np
import pytest
import torch

import finetune.data.cache as cache
from finetune.config import ConfigError, DataConfig
from finetune.data import build_datasets
from finetune.data.loader import StepLoader, collate, epoch_rows, eval_micro_batches
from finetune.data.mix import concat, split_eval, take, take_units, weighted
from finetune.data.packing import pack_ffd
from finetune.data.registry import Encoder, RecordError, get_format
from finetune.data.samples import TokenizedData
from finetune.data.sources import DataError
from finetune.data.template import IGNORE, Message, Pair, Sample, encode_prompt
from finetune.data.tokenizer import load_tokenizer
from finetune.parallel.split import padded_width
from tests.fixtures.data_files import TINY_INSTRUCT, write_lines
from tests.helpers import ROOT, SMALL_VOCAB

SAMPLE = os.path.join(ROOT, "recipes", "data", "sample_preferences.jsonl")
PREFERENCE = get_format("preference")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-common")


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def as_messages(turns):
    return [Message(t["role"], t["content"]) for t in turns]


def expect(tok, prompt_turns, response_turns, pair_side: Sample):
    """pair_side is the SFT encoding of prompt + response, with every prompt token's label IGNORE."""
    sft = Encoder(tok).chat(as_messages(prompt_turns + response_turns))
    shared = len(encode_prompt(as_messages(prompt_turns), tok))
    assert pair_side.input_ids == sft.input_ids
    assert pair_side.labels[:shared] == [IGNORE] * shared
    assert pair_side.labels[shared:] == sft.labels[shared:]
    assert pair_side.labels[shared] != IGNORE, "the response's first token is a target"


# --- the record forms ------------------------------------------------------------------------------------

MULTI_PROMPT = [{"role": "system", "content": "Be brief."}, user("Name a fruit."), assistant("Apple."),
                user("Another?")]


@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_prompt_string_form_is_the_sft_encoding_with_the_prompt_masked(tok, train_on_inputs):
    pair = PREFERENCE({"prompt": "What is 2+2?", "chosen": "4. Happy to help.", "rejected": "FIVE."},
                      Encoder(tok, train_on_inputs=train_on_inputs))
    assert isinstance(pair, Pair)
    expect(tok, [user("What is 2+2?")], [assistant("4. Happy to help.")], pair.chosen)
    expect(tok, [user("What is 2+2?")], [assistant("FIVE.")], pair.rejected)
    shared = len(encode_prompt([Message("user", "What is 2+2?")], tok))
    assert pair.chosen.input_ids[:shared] == pair.rejected.input_ids[:shared]


@pytest.mark.parametrize("chosen", ["Pear.", assistant("Pear."), [assistant("Pear.")],
                                    [assistant("Pear."), user("And one more?"), assistant("Plum.")]])
def test_prompt_conversation_form_each_response_shape(tok, chosen):
    pair = PREFERENCE({"prompt": MULTI_PROMPT, "chosen": chosen, "rejected": "NO."}, Encoder(tok))
    turns = [assistant(chosen)] if isinstance(chosen, str) else [chosen] if isinstance(chosen, dict) else chosen
    expect(tok, MULTI_PROMPT, turns, pair.chosen)
    expect(tok, MULTI_PROMPT, [assistant("NO.")], pair.rejected)
    # SFT trains the prompt's earlier assistant turn ("Apple."); a pair never does
    sft = Encoder(tok).chat(as_messages(MULTI_PROMPT + [assistant("Pear.")]))
    shared = len(encode_prompt(as_messages(MULTI_PROMPT), tok))
    assert any(label != IGNORE for label in sft.labels[:shared])


def test_chat_form_splits_at_the_shared_prefix(tok):
    record = {"chosen": MULTI_PROMPT + [assistant("Pear.")], "rejected": MULTI_PROMPT + [assistant("NO.")]}
    pair = PREFERENCE(record, Encoder(tok))
    same = PREFERENCE({"prompt": MULTI_PROMPT, "chosen": "Pear.", "rejected": "NO."}, Encoder(tok))
    assert pair == same
    expect(tok, MULTI_PROMPT, [assistant("Pear.")], pair.chosen)
    # responses of several turns, of different lengths
    longer = MULTI_PROMPT + [assistant("Pear."), user("More?"), assistant("Plum.")]
    pair = PREFERENCE({"chosen": longer, "rejected": MULTI_PROMPT + [assistant("NO.")]}, Encoder(tok))
    expect(tok, MULTI_PROMPT, longer[len(MULTI_PROMPT):], pair.chosen)


# --- record errors ---------------------------------------------------------------------------------------

CONV = [user("Hi"), assistant("Hello.")]
ERRORS = [
    ({"chosen": "a", "rejected": "b"},
     "missing field 'prompt'; format 'preference' expects {prompt, chosen, rejected}"),
    ({"prompt": "p", "rejected": "b"}, "missing field 'chosen'"),
    ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
    ({"chosen": CONV}, "missing field 'rejected'"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, "field 'chosen' is empty: the chosen response needs text"),
    ({"prompt": "p", "chosen": "a", "rejected": []}, "field 'rejected' is empty: the rejected response needs at least"),
    ({"prompt": "p", "chosen": "a", "rejected": assistant("")}, "field 'rejected.content' is empty"),
    ({"prompt": "p", "chosen": [assistant("a"), user("u"), assistant("")], "rejected": "b"},
     "field 'chosen[2].content' is empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical: a pair must differ"),
    ({"prompt": "p", "chosen": "same", "rejected": [assistant("same")]}, "chosen and rejected are identical"),
    ({"chosen": CONV, "rejected": CONV}, "chosen and rejected are identical: a pair must differ"),
    ({"prompt": 3, "chosen": "a", "rejected": "b"}, "field 'prompt' must be string, got integer"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "field 'chosen' must be string, got integer"),
    ({"prompt": "p", "chosen": ["a"], "rejected": "b"}, "chosen[0] must be a JSON object, got string"),
    ({"prompt": [user("p")], "chosen": [{"role": "assistant"}], "rejected": "b"}, "missing field 'chosen[0].content'"),
    ({"chosen": CONV, "rejected": "b"}, "field 'rejected' must be array, got string"),
    ({"prompt": "p", "chosen": user("a"), "rejected": "b"}, "field 'chosen.role' is 'user': a response starts with"),
    ({"prompt": [user("p"), assistant("a")], "chosen": "a", "rejected": "b"},
     "prompt: conversation must end with a user message"),
    ({"prompt": "p", "chosen": [assistant("a"), user("u")], "rejected": "b"},
     "chosen: conversation must end with an assistant message"),
    ({"chosen": [user("x"), assistant("a")], "rejected": [user("y"), assistant("a")]},
     "chosen and rejected share no prompt: their first messages differ"),
    ({"chosen": CONV + [user("x"), assistant("a")], "rejected": CONV + [user("y"), assistant("a")]},
     "chosen and rejected differ first at message 2, which follows a 'assistant' turn"),
    ({"chosen": CONV, "rejected": CONV + [user("x"), assistant("a")]},
     "field 'chosen' has an empty response: all its messages begin 'rejected' too"),
    ({"chosen": CONV + [user("x"), assistant("a")], "rejected": CONV},
     "field 'rejected' has an empty response"),
    ({"chosen": [user("x"), assistant("a")], "rejected": [user("x"), assistant("")]},
     "rejected: message 1 (assistant) is empty"),
    (["not", "an", "object"], "record must be a JSON object, got array"),
]


@pytest.mark.parametrize("record, message", ERRORS)
def test_record_errors_say_what_to_fix(tok, record, message):
    with pytest.raises(RecordError) as e:
        PREFERENCE(record, Encoder(tok))
    assert message in str(e.value)


def test_a_bad_record_names_file_and_line(tok, tmp_path):
    path = write_lines(tmp_path / "p.jsonl", ['{"prompt": "p", "chosen": "a", "rejected": "b"}',
                                              '{"prompt": "p", "chosen": "a", "rejected": "a"}'])
    with pytest.raises(DataError, match=f"{path}:2: chosen and rejected are identical"):
        build_datasets(DataConfig(path=path, format="preference"), tok, 42, str(tmp_path / "cache"))


# --- paired data through the cache -----------------------------------------------------------------------

def sequences(data, indices=None):
    return [tuple(data.sample(i)[0].tolist()) for i in (range(len(data)) if indices is None else indices)]


def test_the_cache_keeps_paired_and_the_pairs(tmp_path):
    small = load_tokenizer(SMALL_VOCAB)
    cfg = DataConfig(path=SAMPLE, format="preference", max_seq_len=256)
    first, _, report = build_datasets(cfg, small, 42, str(tmp_path))
    again, _, report_again = build_datasets(cfg, small, 42, str(tmp_path))
    assert report.built_cache and not report_again.built_cache
    assert first.paired and again.paired and isinstance(again.input_ids, np.memmap)
    metas = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
    assert len(metas) == 1 and json.load(open(tmp_path / metas[0]))["paired"] is True
    with open(SAMPLE) as f:
        records = [json.loads(line) for line in f]
    # every shipped pair fits 256 tokens: nothing dropped, pair k is samples 2k, 2k+1
    assert len(again) == 2 * len(records) and report_again.samples == len(records) and report.dropped_overlong == 0
    enc = Encoder(small)
    for k in (0, 1, len(records) - 1):
        pair = PREFERENCE(records[k], enc)
        for i, side in ((2 * k, pair.chosen), (2 * k + 1, pair.rejected)):
            ids, labels = again.sample(i)
            assert ids.tolist() == side.input_ids and labels.tolist() == side.labels
    summary = report_again.summary()
    assert summary.startswith(f"{len(records)} training pairs,") and "0 eval pairs" in summary


def test_an_over_long_pair_is_dropped_whole_whatever_overlong_says(tok, tmp_path):
    short = {"prompt": "Hi", "chosen": "Hello.", "rejected": "GO AWAY."}
    long_chosen = {"prompt": "Hi", "chosen": "word " * 40, "rejected": "NO."}
    long_together = {"prompt": "Hi", "chosen": "word " * 14, "rejected": "nope " * 14}  # each fits, not both
    enc = Encoder(tok)
    sizes = [[len(s.input_ids) for s in (p.chosen, p.rejected)] for p in
             (PREFERENCE(r, enc) for r in (short, long_chosen, long_together))]
    limit = 40
    assert sum(sizes[0]) <= limit and sizes[1][0] > limit and max(sizes[2]) <= limit < sum(sizes[2])
    path = write_lines(tmp_path / "p.jsonl", [json.dumps(r) for r in (long_chosen, short, long_together, short)])
    for overlong in ("drop", "truncate"):
        cfg = DataConfig(path=path, format="preference", max_seq_len=limit, overlong=overlong)
        data, _, report = build_datasets(cfg, tok, 42, str(tmp_path / overlong))
        assert report.dropped_overlong == 2 and report.truncated == 0 and report.samples == 2
        assert data.paired and data.lengths.tolist() == sizes[0] * 2
    all_long = write_lines(tmp_path / "long.jsonl", [json.dumps(long_chosen)])
    with pytest.raises(DataError, match=r"1 pairs longer \(chosen and rejected together\) than data.max_seq_len=40"):
        build_datasets(DataConfig(path=all_long, format="preference", max_seq_len=limit), tok, 42, str(tmp_path / "l"))


def _chunk_encoder(tok, fn, max_seq_len=256):
    return cache._ChunkEncoder(tok, "test", fn, DataConfig(path=SAMPLE, max_seq_len=max_seq_len))


def test_a_pair_without_a_target_is_dropped_and_pairs_and_samples_do_not_mix(tok):
    def fn(record, enc):
        pair = PREFERENCE(record, enc)
        if record.get("mask"):  # a plugin whose rejected response trains nothing
            pair.rejected.labels = [IGNORE] * len(pair.rejected.labels)
        return pair

    ids, labels, lengths, counts, kinds = _chunk_encoder(tok, fn)(
        [("f:1", {"prompt": "p", "chosen": "a", "rejected": "b", "mask": True}),
         ("f:2", {"prompt": "p", "chosen": "a", "rejected": "b"})])
    assert counts["dropped_no_target"] == 1 and len(lengths) == 2 and kinds == {"pair": "f:1"}

    def mixed(record, enc):
        return PREFERENCE(record, enc) if "prompt" in record else enc.text(record["text"])

    with pytest.raises(DataError, match="f:2: format 'test' returned a Sample here but a Pair for f:1"):
        _chunk_encoder(tok, mixed)([("f:1", {"prompt": "p", "chosen": "a", "rejected": "b"}), ("f:2", {"text": "t"})])

    def uneven(record, enc):
        pair = PREFERENCE(record, enc)
        pair.rejected.labels = pair.rejected.labels[:-1]
        return pair

    with pytest.raises(ConfigError, match="f:1: format 'test' returned .* input_ids but .* labels"):
        _chunk_encoder(tok, uneven)([("f:1", {"prompt": "p", "chosen": "a", "rejected": "b"})])


def test_a_source_of_pairs_mixed_with_single_samples_is_refused(tok, tmp_path):
    pairs = write_lines(tmp_path / "pairs.jsonl", ['{"prompt": "p", "chosen": "a", "rejected": "b"}'])
    cfg = DataConfig(path=pairs, format="preference", mix=[f"{TINY_INSTRUCT}:1:alpaca"])
    with pytest.raises(ConfigError) as e:
        build_datasets(cfg, tok, 42, str(tmp_path / "cache"))
    assert f"mixes preference pairs ({pairs} (format preference)) with single samples ({TINY_INSTRUCT} (format " \
           f"alpaca))" in str(e.value) and "needs every source in format preference" in str(e.value)


# --- selecting and mixing keep pairs whole ----------------------------------------------------------------

def marked_pairs(n, seed=0):
    """n pairs of varied lengths; pair k's chosen holds 1000 + k, its rejected 2000 + k (after BOS)."""
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(n):
        for mark in (1000 + k, 2000 + k):
            size = int(rng.integers(3, 30))
            samples.append(([1, mark] + [5] * size, [IGNORE, IGNORE] + [5] * size))
    return TokenizedData.from_samples(samples, paired=True)


def pairs_of(data):
    """Pair k's mark for each pair of `data`, checking that each chosen's partner is right after it."""
    marks = [int(data.sample(i)[0][1]) for i in range(len(data))]
    assert all(c < 2000 and r == c + 1000 for c, r in zip(marks[0::2], marks[1::2])), marks
    return [c - 1000 for c in marks[0::2]]


def test_split_eval_weighted_and_concat_move_whole_pairs():
    data = marked_pairs(40)
    train, held = split_eval(data, 0.1, seed=3)
    assert train.paired and held.paired and held.units == 4 and train.units == 36
    assert sorted(pairs_of(train) + pairs_of(held)) == list(range(40))
    heavy = weighted(train, 2.5, seed=3, source=1)
    assert heavy.paired and heavy.units == 90
    counts = np.bincount(pairs_of(heavy), minlength=40)
    assert set(counts[pairs_of(train)]) == {2, 3} and counts[pairs_of(held)].sum() == 0
    light = weighted(train, 0.5, seed=3, source=1)
    assert light.units == 18 and len(set(pairs_of(light))) == 18
    both = concat([heavy, light])
    assert both.paired and pairs_of(both) == pairs_of(heavy) + pairs_of(light)
    assert pairs_of(take_units(data, np.array([7, 2, 7]))) == [7, 2, 7]
    with pytest.raises(ValueError, match="whole pairs"):
        take(data, np.array([1, 2]))
    with pytest.raises(ConfigError, match=r"holds out all 1 pairs"):
        split_eval(take_units(data, np.array([0])), 0.5, seed=0)
    with pytest.raises(ConfigError, match=r"mixes preference pairs \(part 0\) with single samples \(part 1\)"):
        concat([data, TokenizedData.from_samples([([1, 5], [IGNORE, 5])])])
    with pytest.raises(ValueError, match="odd number of samples"):
        TokenizedData.from_samples([([1, 5], [IGNORE, 5])], paired=True)


# --- rows and collate ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_rows_pack_whole_pairs_within_capacity(shuffle):
    data = marked_pairs(60)
    capacity = 64
    pair_lengths = data.lengths[0::2] + data.lengths[1::2]
    rows = epoch_rows(data, capacity, packing=True, shuffle=shuffle, seed=5, epoch=1)
    flat = [i for row in rows for i in row]
    assert sorted(flat) == list(range(len(data)))
    for row in rows:
        assert all(c % 2 == 0 and r == c + 1 for c, r in zip(row[0::2], row[1::2])), row
        assert sum(int(data.lengths[i]) for i in row) <= capacity
    # first-fit decreasing over pairs: unshuffled, the rows are pack_ffd's rows of the pairs' lengths
    ffd = [[i for k in row for i in (2 * k, 2 * k + 1)] for row in pack_ffd(pair_lengths.tolist(), capacity)]
    if shuffle:
        assert len(rows) == len(ffd), "every epoch has as many rows"
    else:
        assert rows == ffd
    unpacked = epoch_rows(data, capacity, packing=False, shuffle=shuffle, seed=5, epoch=1)
    assert sorted(unpacked) == [[2 * k, 2 * k + 1] for k in range(60)]
    if shuffle:
        assert unpacked != sorted(unpacked), "shuffling moves pairs"
        assert epoch_rows(data, capacity, True, True, 5, 2) != rows, "each epoch its own order"


def test_sample_index_marks_each_position_with_its_sample():
    data = marked_pairs(10)
    rows = [[4, 5, 0, 1], None, [8, 9]]
    batch = collate(rows, data, pad_id=0)
    index, ids = batch["sample_index"], batch["sample_ids"].tolist()
    assert index.shape == batch["input_ids"].shape and index.dtype == torch.long
    assert ids == [4, 5, 0, 1, 8, 9]
    assert (index[1] == -1).all(), "an empty row's pad token belongs to no sample"
    for k, (i, n) in enumerate(zip(ids, batch["sample_lengths"].tolist())):
        where = index == k
        assert int(where.sum()) == n == len(data.sample(i)[0])
        assert batch["input_ids"][where].tolist() == data.sample(i)[0].tolist()
    real = batch["input_ids"].shape[1] - (index[2] == -1).sum()
    assert real == sum(len(data.sample(i)[0]) for i in (8, 9)) and (index[2, real:] == -1).all()
    # targets sit on their own sample only: each sample's last position predicts nothing
    for k in range(len(ids)):
        last = (index == k).nonzero()[-1]
        assert batch["targets"][last[0], last[1]] == IGNORE


def test_loaders_hand_out_whole_pairs_and_sequence_parallel_leaves_sample_index_out():
    data = marked_pairs(30)
    loader = StepLoader(data, rows_per_micro=2, grad_accum=2, world=1, rank=0, capacity=80, packing=True, seed=1,
                        pad_id=0)
    seen = []
    for step in range(loader.steps_per_epoch):
        for mb in loader.step(step):
            ids = mb["sample_ids"].tolist()
            assert all(c % 2 == 0 and r == c + 1 for c, r in zip(ids[0::2], ids[1::2]))
            assert mb["sample_index"].max() == len(ids) - 1
            seen += ids
    assert sorted(seen) == list(range(len(data)))
    evaluation = eval_micro_batches(data, 2, world=2, rank=1, capacity=80, packing=False, pad_id=0)
    assert all(len(mb["sample_ids"]) in (0, 2, 4) for mb in evaluation)
    single = TokenizedData.from_samples([([1] + [5] * n, [IGNORE] + [5] * n) for n in range(3, 20)])
    whole = StepLoader(single, 2, 1, 1, 0, 64, True, 1, 0).step(0)
    sliced = StepLoader(single, 2, 1, 1, 0, 64, True, 1, 0, sequence_parallel=(2, 1)).step(0)
    for full, mine in zip(whole, sliced):
        assert "sample_index" in full and "sample_index" not in mine
        assert torch.equal(mine["sample_ids"], full["sample_ids"])
        assert mine["input_ids"].shape[1] == padded_width(full["input_ids"].shape[1], 2) // 2
