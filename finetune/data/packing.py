"""First-fit-decreasing packing of samples into rows of at most `capacity` tokens, and a step's rows into the
micro-batches of each rank.

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
    order = _largest_first(lengths)
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


def balance(costs: Sequence[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Assign indices to ranks, `per_rank` each, largest cost first to the rank with the least cost so far (ties: the
    lower index, the lower rank). The ranks' loads end within the largest cost of one another."""
    assert len(costs) == ranks * per_rank
    order = _largest_first(costs)
    assigned: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in order:
        r = min((r for r in range(ranks) if len(assigned[r]) < per_rank), key=lambda r: (load[r], r))
        assigned[r].append(i)
        load[r] += costs[i]
    return assigned


def micro_batches(rows_tokens: Sequence[int], rows_per_micro: int, ranks: int, per_rank: int) -> list[list[list[int]]]:
    """Each rank's `per_rank` micro-batches (lists of `rows_per_micro` row indices), in the order it runs them.

    The micro-batches depend on the rows only, never on how they are spread over ranks x per_rank: the rows longest
    first (ties: the lower index) in consecutive groups, so rows of similar length share a micro-batch and padding is
    least. 1 rank accumulating 2 micro-batches thus sums the gradients of the same two micro-batches as 2 ranks'
    all-reduce. A micro-batch's cost is its padded size, rows x its longest row: a forward and backward compute over
    padding too, and the ranks wait for the slowest at the all-reduce. Each rank runs its micro-batches in the order of
    the groups (longest first)."""
    order = _largest_first(rows_tokens)
    groups = [order[k:k + rows_per_micro] for k in range(0, len(order), rows_per_micro)]
    costs = [rows_per_micro * rows_tokens[group[0]] for group in groups]
    return [[groups[k] for k in sorted(mine)] for mine in balance(costs, ranks, per_rank)]


def _largest_first(values: Sequence[int]) -> list[int]:
    """Indices of `values`, largest first; ties in index order, so every rank computes the same order."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))
