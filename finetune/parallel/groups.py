"""The process groups of sequence parallelism: the ranks that share rows, each holding a slice of them.

    groups = build(degree)        # every rank, after dist.init; the same object for the same degree in this process

Ranks [g*N, (g+1)*N) form sequence-parallel group g (they share rows; g is their data-parallel rank), so a group
stays inside one node where it can: its all-to-all in every layer is its heaviest traffic.

DeepSpeed gets no `mpu`: its engine treats every rank as data-parallel, which is what ZeRO needs here (each rank's
gradient is part of the step's, partitioned and reduced over every rank, as its sequence-data-parallel group would
be). What an mpu would change is the divisor of the summed gradient, and in DeepSpeed 0.19.8 that depends on the path:
ZeRO-1/2 and ZeRO-3's contiguous path divide by world / N, ZeRO-3's reduce-scatter path (its default) by world. Without
one every path divides by world, and finetune/step.py scales each backward to the step's exact normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.parallel.degree import layout

_BUILT: dict[tuple[int, int], "Groups"] = {}
"""The groups of each (world, degree) built in this process: creating a group is a collective of every rank, and a
process that trains several times (the test drivers) reuses them."""


@dataclass(frozen=True)
class Groups:
    degree: int
    world: int
    rank: int
    sequence_group: Any
    """This rank's sequence-parallel group (the ranks that share its rows)."""

    @property
    def dp_rank(self) -> int:
        return layout(self.rank, self.degree)[0]

    @property
    def sp_rank(self) -> int:
        return layout(self.rank, self.degree)[1]

    @property
    def dp_world(self) -> int:
        return self.world // self.degree


def build(degree: int) -> Groups:
    """This rank's groups for `degree` (> 1), created by every rank together the first time."""
    import torch.distributed as tdist

    world, rank = tdist.get_world_size(), tdist.get_rank()
    if (world, degree) not in _BUILT:
        mine = None
        # Every rank creates every group, in the same order (new_group is a collective of the whole world).
        for g in range(world // degree):
            group = tdist.new_group(list(range(g * degree, (g + 1) * degree)))
            if g == rank // degree:
                mine = group
        _BUILT[(world, degree)] = Groups(degree, world, rank, mine)
    return _BUILT[(world, degree)]
