"""Selecting and combining tokenized samples: held-out eval splits, weighted mixing, concatenation.

    train, held = split_eval(data, 0.1, seed=42); mixed = concat([weighted(train, 2.0, 42, 0), other])
"""

from __future__ import annotations

import math

import numpy as np

from finetune.config import ConfigError
from finetune.data.samples import TokenizedData


def take(data: TokenizedData, indices: np.ndarray) -> TokenizedData:
    """A new TokenizedData of samples `indices` (in that order, repeats allowed)."""
    indices = np.asarray(indices, dtype=np.int64)
    lengths = data.lengths[indices]
    offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    starts = np.asarray(data.offsets)[:-1][indices]
    gather = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lengths)
    return TokenizedData(np.asarray(data.input_ids)[gather], np.asarray(data.labels)[gather], offsets)


def concat(parts: list[TokenizedData]) -> TokenizedData:
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedData(np.concatenate([p.input_ids for p in parts]), np.concatenate([p.labels for p in parts]), offsets)


def split_eval(data: TokenizedData, fraction: float, seed: int, source: int = 0) -> tuple[TokenizedData, TokenizedData | None]:
    """(train, held-out eval): round(fraction x samples), at least 1, chosen by `seed` (and the source's index)."""
    if fraction <= 0:
        return data, None
    n_eval = max(1, int(round(len(data) * fraction)))
    if n_eval >= len(data):
        raise ConfigError(f"data.eval_fraction={fraction} holds out all {len(data)} samples of a source: lower it, "
                          f"or set data.eval_path")
    rng = np.random.default_rng([seed, 12345] if source == 0 else [seed, 12345, source])
    held = np.zeros(len(data), dtype=bool)
    held[rng.permutation(len(data))[:n_eval]] = True
    return take(data, np.flatnonzero(~held)), take(data, np.flatnonzero(held))


def weighted(data: TokenizedData, weight: float, seed: int, source: int) -> TokenizedData:
    """round(weight x n) samples: floor(weight) whole copies, then a subset chosen by (seed, source) for the rest."""
    if weight == 1.0:
        return data
    n = len(data)
    total = int(math.floor(weight * n + 0.5))  # round half up (Python's round() goes to even)
    copies = int(weight)
    extra = total - copies * n
    subset = np.sort(np.random.default_rng([seed, 6789, source]).choice(n, size=extra, replace=False))
    return take(data, np.concatenate([np.tile(np.arange(n), copies), subset]))


