"""Selecting and combining tokenized samples: held-out eval splits, weighted mixing, concatenation.

    train, held = split_eval(data, 0.1, seed=42); mixed = concat([weighted(train, 2.0, 42, 0), other])

Of paired data (preference pairs, TokenizedData.paired) each of these moves whole pairs: the eval split holds out
pairs, a weight repeats pairs, and a pair's chosen and rejected stay adjacent, chosen first.
"""

from __future__ import annotations

import math

import numpy as np

from finetune.config import ConfigError
from finetune.data.samples import TokenizedData


def take(data: TokenizedData, indices: np.ndarray) -> TokenizedData:
    """A new TokenizedData of samples `indices` (in that order, repeats allowed). Of paired data the indices must be
    whole pairs (2k, 2k+1, ...): select pairs with `take_units`."""
    indices = np.asarray(indices, dtype=np.int64)
    if data.paired and (len(indices) % 2 or np.any(indices[0::2] % 2) or np.any(indices[1::2] != indices[0::2] + 1)):
        raise ValueError("take() of paired data needs whole pairs: indices 2k, 2k+1 side by side")
    lengths = data.lengths[indices]
    offsets = np.zeros(len(indices) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    starts = np.asarray(data.offsets)[:-1][indices]
    gather = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lengths)
    return TokenizedData(np.asarray(data.input_ids)[gather], np.asarray(data.labels)[gather], offsets, data.paired)


def take_units(data: TokenizedData, units: np.ndarray) -> TokenizedData:
    """take() by unit: pairs `units` of paired data (both samples of each, chosen first), else samples `units`."""
    units = np.asarray(units, dtype=np.int64)
    return take(data, np.stack([2 * units, 2 * units + 1], axis=1).reshape(-1) if data.paired else units)


def concat(parts: list[TokenizedData], names: list[str] | None = None) -> TokenizedData:
    """The parts one after the other; all paired or none (`names` name the parts in that error)."""
    if len({p.paired for p in parts}) > 1:
        names = names or [f"part {k}" for k in range(len(parts))]
        pairs = ", ".join(n for n, p in zip(names, parts) if p.paired)
        single = ", ".join(n for n, p in zip(names, parts) if not p.paired)
        raise ConfigError(f"the data mixes preference pairs ({pairs}) with single samples ({single}): a preference "
                          f"objective (train.objective dpo, ipo, orpo or simpo) needs every source in format "
                          f"preference, and train.objective sft none")
    if len(parts) == 1:
        return parts[0]
    lengths = np.concatenate([p.lengths for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedData(np.concatenate([p.input_ids for p in parts]), np.concatenate([p.labels for p in parts]),
                         offsets, parts[0].paired)


def split_eval(data: TokenizedData, fraction: float, seed: int, source: int = 0) -> tuple[TokenizedData, TokenizedData | None]:
    """(train, held-out eval): round(fraction x units), at least 1, chosen by `seed` (and the source's index); a unit
    is a sample, or a pair of paired data."""
    if fraction <= 0:
        return data, None
    n = data.units
    n_eval = max(1, int(round(n * fraction)))
    if n_eval >= n:
        raise ConfigError(f"data.eval_fraction={fraction} holds out all {n} {_unit(data)} of a source: lower it, "
                          f"or set data.eval_path")
    rng = np.random.default_rng([seed, 12345] if source == 0 else [seed, 12345, source])
    held = np.zeros(n, dtype=bool)
    held[rng.permutation(n)[:n_eval]] = True
    return take_units(data, np.flatnonzero(~held)), take_units(data, np.flatnonzero(held))


def weighted(data: TokenizedData, weight: float, seed: int, source: int) -> TokenizedData:
    """round(weight x n) units (samples, or pairs of paired data): floor(weight) whole copies, then a subset chosen
    by (seed, source) for the rest."""
    if weight == 1.0:
        return data
    n = data.units
    total = int(math.floor(weight * n + 0.5))  # round half up (Python's round() goes to even)
    copies = int(weight)
    extra = total - copies * n
    subset = np.sort(np.random.default_rng([seed, 6789, source]).choice(n, size=extra, replace=False))
    return take_units(data, np.concatenate([np.tile(np.arange(n), copies), subset]))


def _unit(data: TokenizedData) -> str:
    return "pairs" if data.paired else "samples"
