"""Sequence parallelism's pieces without a process group: the split of a micro-batch, the loader's rows under it,
the degree's checks (prepare's and the launcher's), and the key/value heads each rank gets. The trainings on 2 and 4
ranks: tests/integration/test_sequence_parallel.py."""

import os
import sys

import pytest
import torch

from finetune import parallel
from finetune.config import ConfigError, load_recipe
from finetune.data.loader import IGNORE, StepLoader, collate, eval_micro_batches
from finetune.parallel.split import padded_width, split_rows
from finetune.parallel.ulysses import _whole_kv_heads
from tests.helpers import ROOT, SMALL_VOCAB, TINY_RECIPE
from tests.fixtures.sequence_parallel_cases import ROWS_PER_MICRO, ROWS_PER_STEP, STEPS, overrides

PAD = 0


def _batch(lengths_per_row: list[list[int]]) -> dict[str, torch.Tensor]:
    """A collated micro-batch of made-up samples (token ids 10.., every token a target but each sample's last)."""
    class Data:
        prefix = None  # no shared prompts

        def sample(self, i):
            ids = torch.arange(10 + i, 10 + i + sizes[i]).numpy()
            return ids, ids.copy()

    sizes, rows, k = {}, [], 0
    for lengths in lengths_per_row:
        row = []
        for n in lengths:
            sizes[k] = n
            row.append(k)
            k += 1
        rows.append(row)
    return collate(rows, Data(), PAD)


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_the_slices_side_by_side_are_the_padded_rows(degree):
    batch = _batch([[5, 3, 6], [4]])  # width 14: not a multiple of 3 or 4
    width = batch["input_ids"].shape[1]
    slices = [split_rows(batch, degree, r, PAD) for r in range(degree)]
    whole = {k: torch.cat([s[k] for s in slices], dim=1) for k in ("input_ids", "position_ids", "targets")}
    padded = padded_width(width, degree)
    assert padded % degree == 0 and width <= padded < width + degree
    assert all(s["input_ids"].shape == (2, padded // degree) for s in slices)
    for key in whole:
        assert torch.equal(whole[key][:, :width], batch[key]), key
    extra = padded - width
    assert (whole["input_ids"][:, width:] == PAD).all()
    assert (whole["targets"][:, width:] == IGNORE).all(), "the padding trains nothing"
    # its positions start again at 0: a document of its own
    assert torch.equal(whole["position_ids"][:, width:], torch.arange(extra).expand(2, extra))
    # every target is in exactly one slice: the slices' counts add up to the rows'
    assert sum(int((s["targets"] != IGNORE).sum()) for s in slices) == int((batch["targets"] != IGNORE).sum())
    # what describes the rows stays whole on every rank
    assert all(torch.equal(s["sample_lengths"], batch["sample_lengths"]) for s in slices)
    assert batch["input_ids"].shape[1] == width, "the batch itself is left as it was"


def test_degree_one_is_the_batch_itself():
    batch = _batch([[3, 2]])
    assert split_rows(batch, 1, 0, PAD) is batch
    with pytest.raises(ValueError, match="outside a group of 2"):
        split_rows(batch, 2, 2, PAD)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    from finetune.data import build_datasets
    from finetune.data.tokenizer import load_tokenizer

    tmp = tmp_path_factory.mktemp("spdata")
    recipe = load_recipe(TINY_RECIPE, overrides(SMALL_VOCAB, str(tmp / "o"), False, 2, 1))
    tok = load_tokenizer(SMALL_VOCAB)
    train, evaluation, _ = build_datasets(recipe.data, tok, recipe.train.seed, str(tmp / "cache"))
    return recipe, train, evaluation, tok.pad_id


def _samples_in(full: dict, b: int, lo: int, hi: int) -> int:
    """How many of row b's samples (its position runs from 0 that hold a target) overlap columns [lo, hi)."""
    pos, width = full["position_ids"][b], full["position_ids"].shape[1]
    starts = (pos == 0).nonzero().flatten().tolist() + [width]
    runs = [(s, e) for s, e in zip(starts, starts[1:]) if (full["targets"][b, s:e] != IGNORE).any()]
    return sum(1 for s, e in runs if s < hi and e > lo)


def test_a_group_takes_the_same_rows_and_each_rank_its_slice(tiny_data):
    """The integration test's rows: the 2 ranks of a group take the rows of the one-rank loader, the slices side by
    side are those rows, every slice of a row holds parts of at least two samples, and samples cross the slices'
    boundary (so the all-to-all and the gathered position_ids decide what each token sees)."""
    recipe, data, _, pad = tiny_data
    args = (data, ROWS_PER_MICRO, ROWS_PER_STEP // ROWS_PER_MICRO, 1, 0, recipe.data.max_seq_len, True,
            recipe.train.seed, pad)
    whole = StepLoader(*args)
    ranks = [StepLoader(*args, sequence_parallel=(2, r)) for r in range(2)]
    crossing = slices = 0
    for step in range(STEPS):
        for full, a, b in zip(whole.step(step), *(loader.step(step) for loader in ranks)):
            assert torch.equal(a["sample_ids"], full["sample_ids"]) and torch.equal(b["sample_ids"], full["sample_ids"])
            width, part = full["input_ids"].shape[1], a["input_ids"].shape[1]
            for key in ("input_ids", "position_ids", "targets"):
                assert torch.equal(torch.cat([a[key], b[key]], dim=1)[:, :width], full[key])
            for row in range(full["input_ids"].shape[0]):
                if (full["targets"][row] == IGNORE).all():
                    continue  # an empty row topping up the epoch's last step
                for r in range(2):
                    assert _samples_in(full, row, r * part, (r + 1) * part) >= 2, (step, row, r)
                    slices += 1
            crossing += int((b["position_ids"][:, 0] != 0).sum())
    assert slices >= 2 * STEPS * ROWS_PER_STEP - 8 and crossing >= STEPS


def test_eval_batches_under_sequence_parallelism(tiny_data):
    recipe, _, evaluation, pad = tiny_data
    full = eval_micro_batches(evaluation, 2, 1, 0, recipe.data.max_seq_len, True, pad)
    parts = [eval_micro_batches(evaluation, 2, 1, 0, recipe.data.max_seq_len, True, pad, (2, r)) for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(full)
    for whole, a, b in zip(full, *parts):
        width = whole["targets"].shape[1]
        assert torch.equal(torch.cat([a["targets"], b["targets"]], dim=1)[:, :width], whole["targets"])


def test_layout_and_data_parallel_size():
    assert [parallel.layout(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    recipe = load_recipe(TINY_RECIPE, ["train.sequence_parallel=2"])
    assert parallel.data_parallel_size(recipe, 8) == 4
    assert parallel.degree_of(load_recipe(TINY_RECIPE, [])) == 1  # auto, not yet resolved


def _recipe(*items):
    return load_recipe(TINY_RECIPE, [f"model.tokenizer={SMALL_VOCAB}", *items])


TINY = {"num_attention_heads": 4, "num_key_value_heads": 2}


def test_resolve_degree_checks_world_heads_and_attention():
    assert parallel.resolve_degree(_recipe(), 4, model_config=TINY) == 1  # auto without a plan
    assert parallel.resolve_degree(_recipe(), 4, planned=2, model_config=TINY) == 2
    assert parallel.resolve_degree(_recipe("train.sequence_parallel=4"), 8, model_config=TINY) == 4  # kv copied
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=3 does not divide the 4 rank\(s\) of this run "
                                          r"into groups: set it to one of 1, 2, 4, or launch a multiple of 3 ranks"):
        parallel.resolve_degree(_recipe("train.sequence_parallel=3"), 4, model_config=TINY)
    with pytest.raises(ConfigError, match="does not divide the model's 4 attention heads"):
        parallel.resolve_degree(_recipe("train.sequence_parallel=8"), 8, model_config=TINY)
    with pytest.raises(ConfigError, match="3 key/value heads: one must divide the other"):
        parallel.resolve_degree(_recipe("train.sequence_parallel=2"), 2,
                                model_config={"num_attention_heads": 6, "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="model.attn_implementation=sdpa cannot: set model.attn_implementation=flex"):
        parallel.resolve_degree(_recipe("train.sequence_parallel=2", "model.attn_implementation=sdpa"), 2,
                                model_config=TINY)
    # the head counts come from model.path's config.json when not given
    assert parallel.resolve_degree(_recipe("train.sequence_parallel=2", f"model.path={SMALL_VOCAB}"), 2) == 2


def test_prepare_refuses_a_degree_that_does_not_divide_the_world(tmp_path, monkeypatch):
    from finetune.prepare import prepare

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"train.sequence_parallel=4 does not divide the 2 rank\(s\)"):
        prepare(TINY_RECIPE, "zero2", [f"model.tokenizer={SMALL_VOCAB}", f"model.path={SMALL_VOCAB}",
                                       f"train.output_dir={tmp_path / 'out'}", "train.sequence_parallel=4"])
    assert not os.path.exists(tmp_path / "out"), "refused before the run folder is touched"


def test_the_launcher_refuses_it_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    from finetune.multinode import launcher

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    args = ["--hostfile", str(hostfile), "--dry-run", "--", "--config", TINY_RECIPE]
    assert launcher.main([*args, "train.sequence_parallel=4"]) == 2
    err = capsys.readouterr().err
    assert "zerotune: error: train.sequence_parallel=4 does not divide the 2 rank(s) of this run" in err
    assert launcher.main([*args, "train.sequence_parallel=2"]) == 0


def test_each_rank_gets_the_key_value_head_its_query_heads_read():
    """Fewer key/value heads than ranks: rank r's query heads block must read, after the copy, the key/value head
    that query head q reads without sequence parallelism, q // (heads / kv_heads)."""
    heads, kv, degree = 8, 2, 4
    x = torch.arange(kv, dtype=torch.float32).view(1, kv, 1, 1)
    copied = _whole_kv_heads(x, degree)
    per_rank = heads // degree
    for r in range(degree):
        for q in range(r * per_rank, (r + 1) * per_rank):
            assert copied[0, r, 0, 0] == q // (heads // kv)
    assert _whole_kv_heads(x, 2) is x  # divisible: each rank takes kv / degree of them as they are


def test_parallel_package_imports_no_torch():
    """The launcher imports finetune.parallel.degree on hosts that may lack the GPU stack."""
    import subprocess

    code = "import sys, finetune.parallel.degree; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
