"""Packing and the multipack sampler: packed rows are leak-free on a real (tiny, random) Mistral, every sample is
seen exactly once per epoch on any world size, a step's micro-batches are the same on any world size, ranks get
balanced loads, and bundled data packs >= 95%."""

import math
import os
import re

import numpy as np
import pytest
import torch

from finetune.config import DataConfig
from finetune.data import build_datasets
from finetune.data.loader import IGNORE, StepLoader, TokenizedData, collate, epoch_rows
from finetune.data.packing import balance, micro_batches, pack_ffd
from finetune.data.tokenizer import load_tokenizer
from finetune.commands.preprocess import main as preprocess
from finetune.model.loss import token_loss_sum
from tests.helpers import ROOT, TINY_CONFIG, TINY_RECIPE

TINY_DATA = os.path.join(ROOT, "recipes", "data", "tiny_instruct.jsonl")
SAMPLE_CHAT = os.path.join(ROOT, "recipes", "data", "sample_chat.jsonl")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("mistral-common")


@pytest.fixture(scope="module")
def tiny_data(tok, tmp_path_factory):
    cfg = DataConfig(path=TINY_DATA, format="alpaca", max_seq_len=256)
    train, _, _ = build_datasets(cfg, tok, 42, str(tmp_path_factory.mktemp("cache")))
    return train


def tiny_model(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(TINY_CONFIG))
    config.num_hidden_layers = 2  # two layers still test attention across layers; four only cost time
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn).eval()


# --- 1. packing is leak-free --------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_and_loss_equal_unpacked(tiny_data, tok, attn):
    model = tiny_model(attn)
    rows = epoch_rows(tiny_data, 256, packing=True, shuffle=False, seed=0, epoch=0)
    micro = [rows[0], rows[-1]]  # a full row and the last, shorter one: the batch has padding too
    assert len(micro[0]) >= 3
    packed = collate(micro, tiny_data, tok.pad_id)
    assert "attention_mask" not in packed
    with torch.no_grad():
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        alone = {}
        for i in (i for row in micro for i in row):
            ids = torch.from_numpy(np.asarray(tiny_data.sample(i)[0], dtype=np.int64))[None]
            alone[i] = model(input_ids=ids).logits[0]

    for b, row in enumerate(micro):
        start = 0
        for i in row:
            ids, labels = tiny_data.sample(i)
            n = len(ids)
            assert packed["position_ids"][b, start:start + n].tolist() == list(range(n))
            torch.testing.assert_close(logits[b, start:start + n], alone[i], atol=1e-5, rtol=0)
            # Targets are shifted inside the sample: its last token predicts nothing, never the next sample's BOS.
            targets = packed["targets"][b, start:start + n].tolist()
            assert targets[:-1] == labels[1:].tolist() and targets[-1] == IGNORE
            start += n
        assert (packed["targets"][b, start:] == IGNORE).all()  # padding trains nothing

    # The token-normalised loss of the packed micro-batch equals that of the same samples one per row.
    unpacked = collate([[i] for row in micro for i in row], tiny_data, tok.pad_id)
    with torch.no_grad():
        unpacked_logits = model(input_ids=unpacked["input_ids"], position_ids=unpacked["position_ids"]).logits
    loss_p, n_p = token_loss_sum(logits, packed["targets"])
    loss_u, n_u = token_loss_sum(unpacked_logits, unpacked["targets"])
    assert n_p == n_u > 0
    torch.testing.assert_close(loss_p / n_p, loss_u / n_u, rtol=1e-6, atol=0)


# --- 2. multipack sampler -----------------------------------------------------------------------------

def fake_data(n: int, seed: int, max_len: int = 40) -> TokenizedData:
    """Sample i starts with token 1000 + i, so a collated batch tells which samples it holds."""
    rng = np.random.default_rng(seed)
    samples = []
    for i, length in enumerate(rng.integers(1, max_len + 1, size=n)):
        ids = [1000 + i] + [5] * (int(length) - 1)
        samples.append((ids, [IGNORE] + ids[1:]))
    return TokenizedData.from_samples(samples)


def sample_ids(batch) -> list[int]:
    """Sample indices in a collated batch: each sample's first token where position_ids restart (pad id is 0)."""
    first = batch["input_ids"][batch["position_ids"] == 0]
    return [int(t) - 1000 for t in first if t >= 1000]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("mbs,gas", [(1, 1), (2, 1), (1, 3), (3, 2)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sample_once_per_epoch_on_every_world_size(world, mbs, gas, packing):
    data = fake_data(97, seed=world * 10 + mbs)
    loaders = [StepLoader(data, mbs, gas, world, rank, capacity=64, packing=packing, seed=3, pad_id=0)
               for rank in range(world)]
    steps = loaders[0].steps_per_epoch
    assert all(loader.steps_per_epoch == steps for loader in loaders)
    for epoch in range(2):
        seen = []
        for step in range(epoch * steps, (epoch + 1) * steps):
            for loader in loaders:
                micro_batches = loader.step(step)
                assert len(micro_batches) == gas  # every rank runs the same number of forwards
                for micro in micro_batches:
                    assert micro["input_ids"].shape[0] == mbs
                    assert micro["input_ids"].shape[1] <= (64 if packing else 40)
                    seen += sample_ids(micro)
        assert sorted(seen) == list(range(len(data))), f"epoch {epoch}: a sample was dropped or duplicated"


def test_step_holds_the_same_micro_batches_whatever_the_world_size():
    """1 rank x accumulation 4 and 4 ranks x 1 (and 2 x 2) train each step on the same micro-batches, the same rows
    in the same order, the epoch's last (topped-up) step too: so they sum the same micro-batch gradients."""
    data = fake_data(120, seed=3)
    loaders = {(world, gas): [StepLoader(data, 2, gas, world, rank, 64, True, seed=5, pad_id=0) for rank in range(world)]
               for world, gas in ((1, 4), (2, 2), (4, 1))}
    one = loaders[1, 4][0]
    assert one.rows_per_epoch % one.rows_per_step  # the last step is topped up with empty rows
    steps = one.steps_per_epoch

    def step_micro_batches(world, gas, step):
        return sorted((mb["sample_ids"].tolist(), mb["input_ids"].tolist()) for loader in loaders[world, gas]
                      for mb in loader.step(step))

    for step in range(steps):
        assert step_micro_batches(1, 4, step) == step_micro_batches(4, 1, step) == step_micro_batches(2, 2, step)


def test_balance_gives_each_rank_its_rows_within_one_row_of_tokens():
    rng = np.random.default_rng(0)
    for _ in range(300):
        ranks, per_rank = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        rows = rng.integers(0, 2049, size=ranks * per_rank).tolist()
        assigned = balance(rows, ranks, per_rank)
        assert sorted(i for a in assigned for i in a) == list(range(len(rows)))
        assert all(len(a) == per_rank for a in assigned)
        loads = [sum(rows[i] for i in a) for a in assigned]
        assert max(loads) - min(loads) <= max(rows)


def test_micro_batches_are_the_same_on_every_world_size_and_balanced_by_padded_cost():
    rng = np.random.default_rng(0)
    for _ in range(300):
        mbs = int(rng.integers(1, 5))
        tokens = rng.integers(1, 40, size=4 * mbs).tolist()  # few distinct lengths: ties
        empty = int(rng.integers(0, 4 * mbs))
        tokens[len(tokens) - empty:] = [0] * empty  # a last step's top-up rows
        seen = []
        for world, gas in ((1, 4), (2, 2), (4, 1)):
            spread = micro_batches(tokens, mbs, world, gas)
            assert len(spread) == world and all(len(mine) == gas for mine in spread)
            micros = [micro for mine in spread for micro in mine]
            assert all(len(micro) == mbs for micro in micros)
            assert sorted(i for micro in micros for i in micro) == list(range(len(tokens)))
            seen.append(sorted(micros))
            # Similar lengths share a micro-batch: taken longest first, each one's shortest row is at least the
            # next one's longest.
            by_longest = sorted(micros, key=lambda micro: -max(tokens[i] for i in micro))
            assert all(min(tokens[i] for i in a) >= max(tokens[i] for i in b) for a, b in zip(by_longest, by_longest[1:]))
            costs = [[mbs * max(tokens[i] for i in micro) for micro in mine] for mine in spread]
            loads = [sum(c) for c in costs]
            assert max(loads) - min(loads) <= max(max(c) for c in costs)  # balance's promise
        assert seen[0] == seen[1] == seen[2]


@pytest.mark.parametrize("world,mbs,gas", [(2, 2, 2), (4, 1, 2), (3, 1, 3), (8, 1, 1)])
def test_ranks_get_balanced_token_loads_on_bundled_chat(tok, tmp_path, world, mbs, gas):
    data, _, _ = build_datasets(DataConfig(path=SAMPLE_CHAT, format="messages", max_seq_len=1024), tok, 0, str(tmp_path))
    loaders = [StepLoader(data, mbs, gas, world, rank, 1024, True, seed=1, pad_id=tok.pad_id) for rank in range(world)]
    full_steps = 0
    for step in range(loaders[0].steps_per_epoch):
        steps = [loader.step(step) for loader in loaders]
        loads = [sum(int(mb["sample_lengths"].sum()) for mb in mine) for mine in steps]
        padded = [sum(mb["input_ids"].numel() for mb in mine) for mine in steps]
        # Ranks get whole micro-batches: their padded sizes, and so their tokens, never more than one apart.
        assert max(padded) - min(padded) <= mbs * 1024 and max(loads) - min(loads) <= mbs * 1024
        # FFD leaves one part-filled row per epoch and the last step is topped up with empty rows; when a
        # step's rows are full, the ranks' loads are within 2% (5% with one row per rank: nothing to balance).
        if sum(loads) >= 0.95 * 1024 * mbs * gas * world:
            full_steps += 1
            assert max(loads) / min(loads) <= (1.02 if mbs * gas > 1 else 1.05), (step, loads)
    assert full_steps >= loaders[0].steps_per_epoch - 2


def test_pack_ffd_fits_and_is_near_optimal():
    rng = np.random.default_rng(1)
    for _ in range(20):
        lengths = rng.integers(1, 300, size=500).tolist()
        rows = pack_ffd(lengths, 512)
        assert sorted(i for row in rows for i in row) == list(range(500))
        assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
        # FFD never needs more than 11/9 OPT + 6/9 rows, and OPT >= total / capacity.
        assert len(rows) <= 11 / 9 * math.ceil(sum(lengths) / 512) + 6 / 9 + 1e-9
    with pytest.raises(ValueError, match="a sample of 600 tokens does not fit a row of 512"):
        pack_ffd([10, 600], 512)


def test_preprocess_reports_pack_fill_on_bundled_chat(tmp_path, capsys):
    assert os.path.getsize(SAMPLE_CHAT) < 1_000_000
    code = preprocess(["--config", TINY_RECIPE, "--cache-dir", str(tmp_path), f"data.path={SAMPLE_CHAT}",
                       "data.format=messages", "data.max_seq_len=2048"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"^400 training samples, [\d,]+ tokens", out, re.M), out
    rows, fill = re.search(r"([\d,]+) rows of 2048 tokens per epoch, pack fill ([\d.]+)%", out).groups()
    assert float(fill) >= 95.0, out
