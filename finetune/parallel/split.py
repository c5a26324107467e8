"""This rank's slice of a micro-batch under sequence parallelism: every row padded to a multiple of the degree, then
cut into that many contiguous slices, one per rank of the group.

    mine = split_rows(collate(rows, data, pad_id), degree=2, sp_rank=1, pad_id=pad_id)

The padding trains nothing (targets -100) and its positions start again at 0, so the attention sees it as a document
of its own that no sample attends to. Targets are shifted inside each sample before the split (collate), so a slice's
targets are exactly the rows' targets at its positions: the slices' losses sum to the whole rows' loss. Keys other
than the token tensors (sample_lengths, sample_ids) describe the rows and are kept whole.
"""

from __future__ import annotations

import torch

IGNORE = -100
"""The target of a token that trains nothing (cross_entropy's ignore_index, as finetune/data/loader.py collates)."""

SLICED = ("input_ids", "position_ids", "targets")


def padded_width(width: int, degree: int) -> int:
    """The row width that `degree` ranks split into equal slices: the next multiple of degree."""
    return -(-width // degree) * degree


def split_rows(batch: dict[str, torch.Tensor], degree: int, sp_rank: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The micro-batch as rank `sp_rank` of a group of `degree` ranks trains it: input_ids, position_ids and targets
    ([rows, width]) padded to padded_width and cut to this rank's slice; the batch itself is left as it was."""
    if degree == 1:
        return batch
    if not 0 <= sp_rank < degree:
        raise ValueError(f"sequence-parallel rank {sp_rank} outside a group of {degree}")
    ids, pos, tgt = (batch[k] for k in SLICED)
    rows, width = ids.shape
    extra = padded_width(width, degree) - width
    if extra:
        ids = torch.cat([ids, ids.new_full((rows, extra), pad_id)], dim=1)
        pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype).expand(rows, extra)], dim=1)
        tgt = torch.cat([tgt, tgt.new_full((rows, extra), IGNORE)], dim=1)
    part = (width + extra) // degree
    mine = slice(sp_rank * part, (sp_rank + 1) * part)
    return {**batch, **{k: t[:, mine].contiguous() for k, t in zip(SLICED, (ids, pos, tgt))}}
