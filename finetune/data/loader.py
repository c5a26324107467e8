"""Turn tokenized samples into this rank's micro-batches for each optimizer step, and into tensors.

    loader = StepLoader(train_data, rows_per_micro=4, grad_accum=2, world=2, rank=0, capacity=2048, packing=True, seed=42)
    for micro in loader.step(7): logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"]).logits

This is the one place where ranks meet data. The order of rows depends only on the seed and the epoch, and a step's
micro-batches only on its rows (finetune/data/packing.py micro_batches), never on the world size, so a step holds the
same micro-batches on 1 rank x accumulation 2 as on 2 ranks x 1, and a resumed run continues exactly where it
stopped: the data position is the step number while the rows per step stay the same; a run resumed with other rows
per step starts at the saved run's row (`start`).
"""

from __future__ import annotations

import math
import numpy as np
import torch

from finetune.data.packing import micro_batches, pack_ffd
from finetune.data.samples import TokenizedData
from finetune.parallel.split import split_rows

IGNORE = -100


def epoch_rows(data: TokenizedData, capacity: int, packing: bool, shuffle: bool, seed: int, epoch: int) -> list[list[int]]:
    """Rows (lists of sample indices) of one epoch, in training order.

    Of paired data the unit shuffled and packed is a pair (its length: chosen + rejected, less a shared prompt), so a
    row lists whole pairs, each as 2k, 2k+1 side by side (chosen first); without packing a row is one pair."""
    rng = np.random.default_rng([seed, epoch])
    lengths = data.row_lengths
    if data.paired:
        lengths = lengths[0::2] + lengths[1::2]
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))
    if not packing:
        rows = [[int(i)] for i in order]
    else:
        rows = [[int(order[j]) for j in row] for row in pack_ffd(lengths[order].tolist(), capacity)]
        if shuffle:
            rows = [rows[i] for i in rng.permutation(len(rows))]
    if data.paired:
        rows = [[i for pair in row for i in (2 * pair, 2 * pair + 1)] for row in rows]
    return rows


def step_position(step: int, start: tuple[int, int, int], rows_per_step: int, rows_per_epoch: int) -> tuple[int, int]:
    """(epoch, first row in it) of optimizer step `step` (0-based) when step start[0] begins at row start[2] of epoch
    start[1] and each step takes rows_per_step rows: the last step of an epoch takes what is left of it, the next
    step starts the next epoch."""
    first_step, epoch, row = start
    steps_left = math.ceil((rows_per_epoch - row) / rows_per_step)  # in the start's epoch, its last step included
    k = step - first_step
    if k < steps_left:
        return epoch, row + k * rows_per_step
    epochs, index = divmod(k - steps_left, math.ceil(rows_per_epoch / rows_per_step))
    return epoch + 1 + epochs, index * rows_per_step


class StepLoader:
    """This rank's micro-batches for any optimizer step; a step's global batch is rows_per_micro x grad_accum x world
    rows. `start` = (step, epoch, row): that step begins at that row of that epoch (a run resumed with other rows per
    step than the saved run's: continuing_at); (0, 0, 0) otherwise.

    Under sequence parallelism world and rank are the data-parallel ones (world / N, rank // N: the N ranks of a
    group take the same rows) and `sequence_parallel` = (N, this rank's place in its group): each micro-batch is this
    rank's slice of those rows (finetune/parallel/split.py)."""

    def __init__(self, data: TokenizedData, rows_per_micro: int, grad_accum: int, world: int, rank: int,
                 capacity: int, packing: bool, seed: int, pad_id: int, shuffle: bool = True,
                 start: tuple[int, int, int] = (0, 0, 0), sequence_parallel: tuple[int, int] = (1, 0)):
        self.data, self.mbs, self.gas, self.world, self.rank = data, rows_per_micro, grad_accum, world, rank
        self.capacity, self.packing, self.seed, self.pad_id, self.shuffle = capacity, packing, seed, pad_id, shuffle
        self.sequence_parallel = sequence_parallel
        self.rows_per_step, self.start = rows_per_micro * grad_accum * world, start
        # FFD packs the same multiset of lengths in every epoch, so every epoch has the same number of rows.
        self.rows_per_epoch = len(epoch_rows(data, capacity, packing, False, seed, 0))
        self.steps_per_epoch = math.ceil(self.rows_per_epoch / self.rows_per_step)
        self._epoch, self._rows = -1, []

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, first row in it) of optimizer step `step` (0-based)."""
        return step_position(step, self.start, self.rows_per_step, self.rows_per_epoch)

    def continuing_at(self, step: int, saved: dict[str, int]) -> tuple[int, int, int]:
        """The start at which this loader's step `step` takes the row the saved run's step `step` would have: `saved`
        is that run's {"step", "epoch", "row", "rows_per_step"} (its own start and rows per step)."""
        epoch, row = step_position(step, (saved["step"], saved["epoch"], saved["row"]), saved["rows_per_step"],
                                   self.rows_per_epoch)
        return step, epoch, row

    def step(self, step: int) -> list[dict[str, torch.Tensor]]:
        epoch, first = self.position(step)
        if epoch != self._epoch:
            self._epoch, self._rows = epoch, epoch_rows(self.data, self.capacity, self.packing, self.shuffle, self.seed, epoch)
        rows: list[list[int] | None] = list(self._rows[first:first + self.rows_per_step])
        # The last step of an epoch is topped up with empty rows (no targets), so no sample is dropped or seen twice
        # and every rank still runs the same number of forwards (ZeRO-3 gathers need all ranks).
        rows += [None] * (self.rows_per_step - len(rows))
        # The step's micro-batches are the same on any world size; this rank runs `gas` of them (micro_batches).
        mine = micro_batches([self._row_tokens(r) for r in rows], self.mbs, self.world, self.gas)[self.rank]
        return [_slice(collate([rows[i] for i in micro], self.data, self.pad_id), self.sequence_parallel, self.pad_id)
                for micro in mine]

    def _row_tokens(self, row: list[int] | None) -> int:
        return 0 if row is None else int(sum(self.data.row_lengths[i] for i in row))


def eval_micro_batches(data: TokenizedData, rows_per_micro: int, world: int, rank: int, capacity: int,
                       packing: bool, pad_id: int, sequence_parallel: tuple[int, int] = (1, 0)
                       ) -> list[dict[str, torch.Tensor]]:
    """This rank's share of the eval rows; every rank gets the same number of micro-batches. world, rank and
    sequence_parallel as StepLoader takes them."""
    rows: list[list[int] | None] = list(epoch_rows(data, capacity, packing, False, 0, 0))
    per_rank = math.ceil(len(rows) / world / rows_per_micro) * rows_per_micro
    rows += [None] * (per_rank * world - len(rows))
    mine = rows[rank::world]
    return [_slice(collate(mine[k:k + rows_per_micro], data, pad_id), sequence_parallel, pad_id)
            for k in range(0, len(mine), rows_per_micro)]


def _slice(batch: dict[str, torch.Tensor], sequence_parallel: tuple[int, int], pad_id: int) -> dict[str, torch.Tensor]:
    """This rank's slice of the rows (split_rows). Under sequence parallelism sample_index is left out: it spans
    whole rows, and what reads it (a preference objective) refuses sequence parallelism."""
    degree, sp_rank = sequence_parallel
    if degree > 1:
        batch = {k: v for k, v in batch.items() if k != "sample_index"}
    return split_rows(batch, degree, sp_rank, pad_id)


def collate(rows: list[list[int] | None], data: TokenizedData, pad_id: int) -> dict[str, torch.Tensor]:
    """Rows of samples -> input_ids, position_ids (restarting per sample), targets (next token, -100 off-target).

    Targets are shifted inside each sample, so no sample is ever trained to predict its neighbour's first token;
    position_ids restarting at 0 is what tells transformers to isolate each sample's attention (a block-diagonal
    causal mask with sdpa/eager, variable-length kernels with flash attention), so no attention_mask is passed.
    sample_index gives each position's sample as its place in sample_ids (-1 on padding), for per-sequence sums.

    Pairs with shared prompts (data.prefix): the rejected sequence's first prefix[k] tokens are not repeated; its rest
    follows the chosen sequence with positions continuing from prefix[k] (the attention reads that as "also sees the
    previous sample's first prefix[k] tokens"). Its first token after the prompt is predicted at the chosen copy's
    last prompt position, which predicts the chosen response too: that second target is a `branch_targets` row
    (row, position, token, place in sample_ids), [n, 4].
    """
    ids_rows, pos_rows, tgt_rows, index_rows, lengths, sample_ids, branches = [], [], [], [], [], [], []
    for b, row in enumerate(rows):
        ids, pos, tgt, index, at, previous_at = [], [], [], [], 0, 0
        for i in row or []:
            s_ids, s_labels = data.sample(i)
            start = int(data.prefix[i // 2]) if data.prefix is not None and i % 2 else 0
            if start and s_labels[start] != IGNORE:  # predicted at the chosen copy's (the previous sample's) start-1
                branches.append((b, previous_at + start - 1, int(s_labels[start]), len(sample_ids)))
            ids.append(s_ids[start:])
            pos.append(np.arange(start, len(s_ids)))
            tgt.append(np.append(s_labels[start + 1:], IGNORE))
            index.append(np.full(len(s_ids) - start, len(sample_ids)))
            lengths.append(len(s_ids) - start)
            previous_at, at = at, at + len(s_ids) - start
            sample_ids.append(i)
        if not ids:  # an empty row: one pad token that trains nothing
            ids, pos, tgt, index = [np.array([pad_id])], [np.array([0])], [np.array([IGNORE])], [np.array([-1])]
        ids_rows.append(np.concatenate(ids))
        pos_rows.append(np.concatenate(pos))
        tgt_rows.append(np.concatenate(tgt))
        index_rows.append(np.concatenate(index))
    width = max(len(r) for r in ids_rows)
    batch = {
        "input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
        "position_ids": torch.zeros((len(rows), width), dtype=torch.long),
        "targets": torch.full((len(rows), width), IGNORE, dtype=torch.long),
    }
    sample_index = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (ids, pos, tgt, index) in enumerate(zip(ids_rows, pos_rows, tgt_rows, index_rows)):
        n = len(ids)
        batch["input_ids"][b, :n] = torch.from_numpy(ids.astype(np.int64))
        batch["position_ids"][b, :n] = torch.from_numpy(pos.astype(np.int64))
        batch["position_ids"][b, n:] = torch.arange(width - n)  # padding is a sequence of its own
        batch["targets"][b, :n] = torch.from_numpy(tgt.astype(np.int64))
        sample_index[b, :n] = torch.from_numpy(index.astype(np.int64))
    batch["sample_lengths"] = torch.tensor(lengths, dtype=torch.long)
    batch["sample_ids"] = torch.tensor(sample_ids, dtype=torch.long)  # indices into the tokenized data, for errors
    batch["sample_index"] = sample_index
    if data.prefix is not None:
        batch["branch_targets"] = torch.tensor(branches, dtype=torch.long).view(-1, 4)
    return batch
