"""Records -> plugin -> input_ids/labels -> over-long policy -> a tokenized cache shared by all ranks.

    data = load_or_tokenize(path, recipe.data, tokenizer, cache_dir, report, format="alpaca")

Tokenization runs once per (file, recipe, tokenizer, format code) on the first rank of each node, in worker
processes with data.num_proc > 1; the others wait and load the cached arrays. A format that returns Pairs (format
preference) gives paired data: a pair is kept or dropped whole, its chosen then its rejected sequence stored. This
module imports neither torch nor the loader at import time: tokenizer worker processes import it.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import multiprocessing
import os
import pickle
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from finetune import __version__, dist
from finetune.config import ConfigError, DataConfig
from finetune.data import registry, template
from finetune.data.registry import Encoder, RecordError, get_format
from finetune.data.samples import TokenizedData
from finetune.data.sources import DataError, file_fingerprint, parse_raw, read_raw
from finetune.data.template import Pair
from finetune.run import folder as run_folder

CHUNK_RECORDS = 256  # records per worker task: large enough to amortise pickling, small enough to spread a small file
_COUNTS = ("records", "dropped_overlong", "truncated", "dropped_no_target")
CACHE_LAYOUT = 2
"""The layout of a cache entry, part of its key: 2 records `paired` in the metadata (1 did not)."""


class ReportedElsewhere(DataError):
    """Raised on the ranks that waited for a cache entry another rank failed to build: that rank holds the error
    and reports it (finetune/train.py prints it once)."""


@dataclass
class DataReport:
    samples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    eval_samples: int = 0
    paired: bool = False
    """Preference data: samples, eval_samples and the drop counts are pairs (each of two sequences)."""
    built_cache: bool = False
    """True if this rank tokenized at least one source (False: every source came from the cache)."""
    tokenize_seconds: float = 0.0
    """Time this rank spent tokenizing and writing the cache."""
    tokenized_tokens: int = 0
    """Tokens this rank tokenized into the cache (before eval hold-out and mixing weights)."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """Per source: path, format, weight, samples (after drops and eval hold-out) and used (after weighting), in pairs
    for paired data."""
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        unit = "pairs" if self.paired else "samples"
        text = (f"{self.samples:,} training {unit}, {self.tokens:,} tokens ({self.target_tokens:,} trained), "
                f"{self.eval_samples:,} eval {unit}; dropped {self.dropped_overlong:,} over-long and "
                f"{self.dropped_no_target:,} with nothing to train, truncated {self.truncated:,}")
        if len(self.sources) > 1:
            text += "; mix: " + ", ".join(f"{s['path']} {s['samples']:,} x {s['weight']:g} = {s['used']:,}"
                                          for s in self.sources)
        return text + "".join(f"; {note}" for note in self.notes)


# --- tokenizing: the same chunk function runs in this process or in each pool worker ----------------------

class _ChunkEncoder:
    """(where, raw record) chunk -> flat int32 ids/labels, sample lengths, drop counts, and where the chunk's first
    Sample and first Pair came from ({"sample": where, "pair": where}, for the one-kind-per-format check)."""

    def __init__(self, tokenizer, format_name: str, format_fn, cfg: DataConfig):
        self.format_name, self.format_fn = format_name, format_fn
        self.encoder = Encoder(tokenizer, train_on_inputs=cfg.train_on_inputs)
        self.max_seq_len, self.overlong = cfg.max_seq_len, cfg.overlong

    def __call__(self, chunk: list[tuple[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int],
                                                            dict[str, str]]:
        counts = dict.fromkeys(_COUNTS, 0)
        kinds: dict[str, str] = {}
        ids_flat: list[int] = []
        labels_flat: list[int] = []
        lengths: list[int] = []
        for where, raw in chunk:
            record = parse_raw(where, raw)
            counts["records"] += 1
            try:
                out = self.format_fn(record, self.encoder)
            except (RecordError, ValueError, TypeError, KeyError) as e:
                raise DataError(f"{where}: {e}") from None
            kind = "pair" if isinstance(out, Pair) else "sample"
            kinds.setdefault(kind, where)
            _check_one_kind(kinds, kind, where, self.format_name)
            kept = self._pair(where, out, counts) if kind == "pair" else self._sample(where, out, counts)
            for ids, labels in kept:
                ids_flat += ids
                labels_flat += labels
                lengths.append(len(ids))
        return (np.array(ids_flat, dtype=np.int32), np.array(labels_flat, dtype=np.int32),
                np.array(lengths, dtype=np.int64), counts, kinds)

    def _checked(self, where: str, sample) -> tuple[list[int], list[int]]:
        ids, labels = list(sample.input_ids), list(sample.labels)
        if len(ids) != len(labels):
            raise ConfigError(f"{where}: format {self.format_name!r} returned {len(ids)} input_ids but "
                              f"{len(labels)} labels; they must have equal length (fix the plugin)")
        return ids, labels

    def _sample(self, where: str, sample, counts: dict[str, int]) -> list[tuple[list[int], list[int]]]:
        ids, labels = self._checked(where, sample)
        if len(ids) > self.max_seq_len:
            if self.overlong == "drop":
                counts["dropped_overlong"] += 1
                return []
            ids, labels = ids[:self.max_seq_len], labels[:self.max_seq_len]
            counts["truncated"] += 1
        if not _has_target(labels):
            counts["dropped_no_target"] += 1
            return []
        return [(ids, labels)]

    def _pair(self, where: str, pair: Pair, counts: dict[str, int]) -> list[tuple[list[int], list[int]]]:
        """Both sequences, or none. A packed row holds whole pairs, so a pair longer than data.max_seq_len (its two
        sequences together) is dropped, whatever data.overlong says: truncating would cut the responses compared."""
        both = [self._checked(where, pair.chosen), self._checked(where, pair.rejected)]
        if sum(len(ids) for ids, _ in both) > self.max_seq_len:
            counts["dropped_overlong"] += 1
            return []
        if not all(_has_target(labels) for _, labels in both):
            counts["dropped_no_target"] += 1
            return []
        return both


def _has_target(labels: list[int]) -> bool:
    # labels[0] can never be a target (nothing predicts the first token), so it does not count.
    return any(label != -100 for label in labels[1:])


def _check_one_kind(kinds: dict[str, str], kind: str, where: str, format_name: str) -> None:
    """A DataError if `kinds` (kind -> where its first record came from) holds both Samples and Pairs."""
    if len(kinds) > 1:
        other = "sample" if kind == "pair" else "pair"
        raise DataError(f"{where}: format {format_name!r} returned a {kind.capitalize()} here but a "
                        f"{other.capitalize()} for {kinds[other]}: a format returns Samples for every record or "
                        f"Pairs for every record (fix the plugin)")


_WORKER: _ChunkEncoder | None = None  # set once per pool worker by _init_worker


def _init_worker(encoder: _ChunkEncoder) -> None:
    global _WORKER
    _WORKER = encoder


def _run_chunk(chunk: list[tuple[str, Any]]):
    return _WORKER(chunk)


def _chunks(pairs: Iterable[tuple[str, Any]], size: int) -> Iterator[list[tuple[str, Any]]]:
    chunk = []
    for pair in pairs:
        chunk.append(pair)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _pool_map(encoder: _ChunkEncoder, chunks: Iterator[list], num_proc: int) -> Iterator[tuple]:
    """encoder(chunk) for each chunk on `num_proc` workers, results in input order (so identical to num_proc=1).

    Workers are spawned, not forked: the parent may hold CUDA, gloo/NCCL threads and a Rust tokenizer's
    thread pool, none of which survive a fork safely. At most 2 x num_proc chunks are in flight, so a large
    file is never read into memory ahead of the workers.

    A chunk's error (a bad record) ends the map: the chunks not started are cancelled and the ones running finish
    before the workers exit. multiprocessing.Pool would instead terminate its workers on leaving its `with`, and a
    worker killed while it writes its result holds the result queue's lock for good: the pool's own threads then
    wait on it, and the run hangs at its start instead of naming the bad line.
    """
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(num_proc, mp_context=context, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending: deque = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_run_chunk, chunk))
                if len(pending) >= 2 * num_proc:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def tokenize_file(path: str, cfg: DataConfig, tokenizer, report: DataReport, format: str | None = None) -> TokenizedData:
    """Every record of one file through its format plugin (`format`, default data.format), on data.num_proc
    processes; adds the drop counts to `report`. Errors name the file and line or row."""
    name = format or cfg.format
    encoder = _ChunkEncoder(tokenizer, name, get_format(name), cfg)
    chunks = _chunks(read_raw(path), CHUNK_RECORDS)
    first = list(itertools.islice(chunks, 2))
    chunks = itertools.chain(first, chunks)
    if cfg.num_proc > 1 and len(first) > 1:  # a file of one chunk is done before a worker would have started
        _check_picklable(encoder, name)
        results = list(_pool_map(encoder, chunks, cfg.num_proc))
    else:
        results = [encoder(chunk) for chunk in chunks]
    counts = {k: sum(r[3][k] for r in results) for k in _COUNTS}
    kinds: dict[str, str] = {}
    for r in results:
        for kind, where in r[4].items():
            kinds.setdefault(kind, where)
            _check_one_kind(kinds, kind, where, name)
    paired = "pair" in kinds
    for k in _COUNTS[1:]:
        setattr(report, k, getattr(report, k) + counts[k])
    if counts["records"] == 0:
        raise DataError(f"{path}: the dataset is empty: no records found; point the recipe at a file with records")
    lengths = np.concatenate([r[2] for r in results])
    if len(lengths) == 0:
        longer = "pairs longer (chosen and rejected together) than" if paired else "longer than"
        fix = "data.max_seq_len (a row holds a whole pair)" if paired else \
            "data.max_seq_len, set data.overlong=truncate,"
        raise DataError(
            f"{path}: all {counts['records']} records were dropped ({counts['dropped_overlong']} {longer} "
            f"data.max_seq_len={cfg.max_seq_len}, {counts['dropped_no_target']} with no trained tokens): raise "
            f"{fix} or check data.format={name!r}"
        )
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedData(np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results]), offsets,
                         paired)


def _check_picklable(encoder: _ChunkEncoder, name: str) -> None:
    try:
        pickle.dumps(encoder)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ConfigError(f"data.num_proc > 1 needs format {name!r} and the tokenizer to be importable by worker "
                          f"processes ({e}): define the format at module level in a `data.plugins` module, "
                          f"or set data.num_proc=1") from None


# --- the cache: built once per node, read by every rank -------------------------------------------------

def _code_fingerprint(format_name: str) -> str:
    """Hash of the code that turns records into tokens, so editing a plugin or the template rebuilds the cache."""
    h = hashlib.sha256()
    modules = {inspect.getsourcefile(registry.get_format(format_name)), inspect.getsourcefile(template),
               inspect.getsourcefile(registry)}  # registry holds Encoder.text and the field checks
    for module_file in sorted(modules):
        with open(module_file, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def cache_key(path: str, cfg: DataConfig, tokenizer, format: str | None = None) -> str:
    """Names a source's cache entry: data content, tokenizer, format code and every setting that changes the tokens."""
    name = format or cfg.format
    parts = {
        "data": file_fingerprint(path),
        "tokenizer": tokenizer.fingerprint(),
        "format": name,
        "code": _code_fingerprint(name),
        "plugins": cfg.plugins,
        "max_seq_len": cfg.max_seq_len,
        "overlong": cfg.overlong,
        "train_on_inputs": cfg.train_on_inputs,
        "version": __version__,
        "layout": CACHE_LAYOUT,
    }  # not num_proc: the tokens do not depend on it
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


_ARRAYS = ("input_ids", "labels", "offsets")


def _save(base: str, data: TokenizedData, meta: dict[str, Any]) -> None:
    for name in _ARRAYS:
        with run_folder.atomic_open(f"{base}.{name}.npy", "wb", durable=False) as f:
            np.save(f, getattr(data, name))
    # The metadata file is written last and atomically: a reader that sees it sees complete arrays. A cache is
    # rebuilt from the data when lost, so it needs no fsync.
    with run_folder.atomic_open(f"{base}.json", durable=False) as f:
        json.dump(meta, f)


def load_or_tokenize(path: str, cfg: DataConfig, tokenizer, cache_dir: str, report: DataReport,
                     format: str | None = None) -> TokenizedData:
    """Tokenize on the first rank of each node into `cache_dir` unless already there; every rank then reads it.

    Arrays are memory-mapped, so the ranks of a node share one copy in the page cache.
    """
    base = os.path.join(cache_dir, cache_key(path, cfg, tokenizer, format))
    ok = False
    try:
        if dist.local_rank() == 0 and not os.path.exists(f"{base}.json"):
            os.makedirs(cache_dir, exist_ok=True)
            start = time.perf_counter()
            local = DataReport()
            data = tokenize_file(path, cfg, tokenizer, local, format)
            _save(base, data, {"source": path, "format": format or cfg.format, "paired": data.paired,
                               **{k: getattr(local, k) for k in _COUNTS[1:]}})
            report.built_cache = True
            report.tokenize_seconds += time.perf_counter() - start
            report.tokenized_tokens += int(data.offsets[-1])
        ok = True
    finally:
        # Every rank joins this, also when the build raised: the waiting ranks then stop with an error
        # instead of hanging until the process-group timeout.
        failed = dist.all_reduce_max(0.0 if ok else 1.0)
    if failed:
        raise ReportedElsewhere(f"{path}: tokenizing failed on the first rank of a node; its error is in that rank's log")
    with open(f"{base}.json") as f:
        counts = json.load(f)
    data = TokenizedData(*(np.load(f"{base}.{name}.npy", mmap_mode="r") for name in _ARRAYS), paired=counts["paired"])
    for k in _COUNTS[1:]:
        setattr(report, k, getattr(report, k) + counts[k])
    return data
