"""Tokenized samples stored flat in three numpy arrays (no torch: tokenizer worker processes import it).

    data = TokenizedData.from_samples([([1, 5, 6], [-100, 5, 6])]); ids, labels = data.sample(0)

Preference data is `paired`: samples 2k (chosen) and 2k+1 (rejected) are pair k, and everything that selects,
mixes or packs samples moves whole pairs (finetune/data/mix.py, finetune/data/loader.py).
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
