"""First-fit-decreasing packing of samples into rows of at most `capacity` tokens.

    rows = pack_ffd([512, 2000, 30, ...], capacity=2048)   # -> [[1, 2], [0, ...], ...] sample indices per row

A max-segment-tree over the rows' free space finds the first row that fits in O(log n), so an epoch
of a million samples packs in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_ffd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices, filled first-fit in order of decreasing length. Every index appears exactly once."""
    n = len(lengths)
    if n == 0:
        return []
    if max(lengths) > capacity:
        raise ValueError(f"a sample of {max(lengths)} tokens does not fit a row of {capacity}")
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    size = 1
    while size < n:
        size *= 2
    free = [0] * (2 * size)  # leaves: free space of row k (rows not yet opened hold `capacity`)
    for k in range(size):
        free[size + k] = capacity
    for k in range(size - 1, 0, -1):
        free[k] = max(free[2 * k], free[2 * k + 1])
    rows: list[list[int]] = []
    for i in order:
        need = lengths[i]
        k = 1
        while k < size:  # descend to the leftmost leaf with room
            k = 2 * k if free[2 * k] >= need else 2 * k + 1
        row = k - size
        if row == len(rows):
            rows.append([])
        rows[row].append(i)
        free[k] -= need
        k //= 2
        while k:
            free[k] = max(free[2 * k], free[2 * k + 1])
            k //= 2
    return rows


def balance(rows_tokens: Sequence[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Assign row indices to ranks, `per_rank` each, largest first to the rank with the fewest tokens so far."""
    assert len(rows_tokens) == ranks * per_rank
    order = sorted(range(len(rows_tokens)), key=lambda i: (-rows_tokens[i], i))
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in order:
        r = min((r for r in range(ranks) if len(assigned[r]) < per_rank), key=lambda r: (load[r], r))
        assigned[r].append(i)
        load[r] += rows_tokens[i]
    return assigned
