"""Tokenized samples stored flat in three numpy arrays (no torch: tokenizer worker processes import it).

    data = TokenizedData.from_samples([([1, 5, 6], [-100, 5, 6])]); ids, labels = data.sample(0)

Preference data is `paired`: samples 2k (chosen) and 2k+1 (rejected) are pair k, and everything that selects,
mixes or packs samples moves whole pairs (finetune/data/mix.py, finetune/data/loader.py). `with_shared_prompts()`
lays each pair out with one copy of the prompt the two sequences share (`prefix`): the loader then puts the rejected
sequence's rest right after the chosen sequence, and the attention lets it see that prompt (finetune/perf/attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenizedData:
    """Samples stored flat: sample i is input_ids[offsets[i]:offsets[i+1]] (labels alike, unshifted)."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    paired: bool = False
    """True: samples 2k and 2k+1 are the chosen and rejected sequence of preference pair k."""
    prefix: np.ndarray | None = None
    """Paired data with shared prompts: prefix[k] leading tokens of pair k's rejected sequence are its chosen
    sequence's, and a row holds them once (the chosen copy); None: every sequence whole."""

    def __post_init__(self):
        if self.paired and len(self) % 2:
            raise ValueError(f"paired data holds whole pairs, but has an odd number of samples ({len(self)})")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def units(self) -> int:
        """What selecting and packing move: pairs when paired, else samples."""
        return len(self) // 2 if self.paired else len(self)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def row_lengths(self) -> np.ndarray:
        """The tokens each sample takes in a row: its length, less the shared prompt of a rejected sequence."""
        lengths = self.lengths
        if self.prefix is None:
            return lengths
        lengths = lengths.copy()
        lengths[1::2] -= self.prefix
        return lengths

    def with_shared_prompts(self) -> "TokenizedData":
        """This paired data laid out with shared prompts (the same arrays, `prefix` set)."""
        if not self.paired:
            raise ValueError("only preference pairs share prompts")
        return TokenizedData(self.input_ids, self.labels, self.offsets, True, shared_prefix_lengths(self))

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.labels[a:b]

    @classmethod
    def from_samples(cls, samples: list[tuple[list[int], list[int]]], paired: bool = False) -> "TokenizedData":
        lengths = [len(ids) for ids, _ in samples]
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = lambda k: np.fromiter((t for s in samples for t in s[k]), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat(0), flat(1), offsets, paired)


def shared_prefix_lengths(data: TokenizedData) -> np.ndarray:
    """Per pair, how many leading tokens its rejected sequence shares with its chosen one and takes from it: the
    common prefix of their ids up to the first target of either (-100 labels only: a shared target would have to be
    scored twice). Never the whole chosen sequence, which always has a target (an empty response is refused)."""
    out = np.zeros(data.units, dtype=np.int64)
    for k in range(data.units):
        c_ids, c_labels = data.sample(2 * k)
        r_ids, r_labels = data.sample(2 * k + 1)
        n = min(len(c_ids), len(r_ids))
        stop = (c_ids[:n] != r_ids[:n]) | (c_labels[:n] != -100) | (r_labels[:n] != -100)
        out[k] = int(np.argmax(stop)) if stop.any() else n
    return out
