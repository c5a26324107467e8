"""Records -> plugin -> input_ids/labels -> over-long policy -> tokenized cache, shared by all ranks.

    train, evaluation, report = build_datasets(recipe.data, tokenizer, seed=42, cache_dir="runs/x/.cache")

Plugins (finetune/data/formats.py, or a module named in data.plugins) see one record at a time and never
ranks, padding or samplers; the loader (finetune/data/loader.py) is the one place where ranks meet data.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np

from finetune import __version__
from finetune.config import ConfigError, DataConfig
from finetune.data.loader import TokenizedData
from finetune.data.sources import file_fingerprint, read_records


@dataclass
class DataReport:
    samples: int = 0
    tokens: int = 0
    target_tokens: int = 0
    dropped_overlong: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    eval_samples: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.samples:,} training samples, {self.tokens:,} tokens ({self.target_tokens:,} trained), "
                f"{self.eval_samples:,} eval samples; dropped {self.dropped_overlong:,} over-long and "
                f"{self.dropped_no_target:,} with nothing to train, truncated {self.truncated:,}")


def tokenize_file(path: str, cfg: DataConfig, tokenizer, report: DataReport) -> TokenizedData:
    """Every record of one file through its format plugin; errors name the file and line or row."""
    from finetune.data.registry import Encoder, RecordError, get_format, load_plugins

    load_plugins(cfg.plugins)
    fmt = get_format(cfg.format)
    encoder = Encoder(tokenizer, train_on_inputs=cfg.train_on_inputs)
    samples = []
    seen = 0
    for where, record in read_records(path):
        seen += 1
        try:
            sample = fmt(record, encoder)
        except (RecordError, ValueError, TypeError, KeyError) as e:
            raise ConfigError(f"{where}: {e}") from None
        ids, labels = list(sample.input_ids), list(sample.labels)
        if len(ids) > cfg.max_seq_len:
            if cfg.overlong == "drop":
                report.dropped_overlong += 1
                continue
            ids, labels = ids[:cfg.max_seq_len], labels[:cfg.max_seq_len]
            report.truncated += 1
        # labels[0] can never be a target (nothing predicts the first token), so it does not count.
        if not any(label != -100 for label in labels[1:]):
            report.dropped_no_target += 1
            continue
        samples.append((ids, labels))
    if seen == 0:
        raise ConfigError(f"{path}: the dataset is empty: no records found")
    if not samples:
        raise ConfigError(
            f"{path}: all {seen} records were dropped ({report.dropped_overlong} longer than data.max_seq_len="
            f"{cfg.max_seq_len}, {report.dropped_no_target} with no trained tokens): raise data.max_seq_len, "
            f"set data.overlong=truncate, or check data.format={cfg.format!r}"
        )
    return TokenizedData.from_samples(samples)


def cache_key(path: str, cfg: DataConfig, tokenizer) -> str:
    parts = {
        "data": file_fingerprint(path),
        "tokenizer": tokenizer.fingerprint(),
        "format": cfg.format,
        "plugins": cfg.plugins,
        "max_seq_len": cfg.max_seq_len,
        "overlong": cfg.overlong,
        "train_on_inputs": cfg.train_on_inputs,
        "version": __version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def load_or_tokenize(path: str, cfg: DataConfig, tokenizer, cache_dir: str, report: DataReport) -> TokenizedData:
    """Tokenize on the first rank of each node into `cache_dir`; the other ranks wait and read it."""
    from finetune import dist

    key = cache_key(path, cfg, tokenizer)
    file = os.path.join(cache_dir, f"{key}.npz")
    meta = os.path.join(cache_dir, f"{key}.json")
    if dist.local_rank() == 0 and not os.path.exists(file):
        os.makedirs(cache_dir, exist_ok=True)
        local = DataReport()
        data = tokenize_file(path, cfg, tokenizer, local)
        tmp = f"{file}.{os.getpid()}.tmp.npz"
        np.savez(tmp, input_ids=data.input_ids, labels=data.labels, offsets=data.offsets)
        with open(f"{meta}.{os.getpid()}.tmp", "w") as f:
            json.dump({"source": path, **{k: v for k, v in local.__dict__.items() if k != "notes"}}, f)
        os.replace(f"{meta}.{os.getpid()}.tmp", meta)
        os.replace(tmp, file)  # atomic: readers see the whole cache or none
    dist.barrier()
    with np.load(file) as z:
        data = TokenizedData(z["input_ids"], z["labels"], z["offsets"])
    with open(meta) as f:
        counts = json.load(f)
    for k in ("dropped_overlong", "truncated", "dropped_no_target"):
        setattr(report, k, getattr(report, k) + counts[k])
    return data


def split_eval(data: TokenizedData, fraction: float, seed: int) -> tuple[TokenizedData, TokenizedData | None]:
    if fraction <= 0:
        return data, None
    n_eval = max(1, int(round(len(data) * fraction)))
    order = np.random.default_rng([seed, 12345]).permutation(len(data))
    held = set(order[:n_eval].tolist())
    pick = lambda keep: TokenizedData.from_samples(
        [tuple(a.tolist() for a in data.sample(i)) for i in range(len(data)) if (i in held) != keep]
    )
    return pick(True), pick(False)


def build_datasets(cfg: DataConfig, tokenizer, seed: int, cache_dir: str) -> tuple[TokenizedData, TokenizedData | None, DataReport]:
    report = DataReport()
    train = load_or_tokenize(cfg.path, cfg, tokenizer, cache_dir, report)
    evaluation = None
    if cfg.eval_path:
        evaluation = load_or_tokenize(cfg.eval_path, cfg, tokenizer, cache_dir, report)
    elif cfg.eval_fraction > 0:
        train, evaluation = split_eval(train, cfg.eval_fraction, seed)
    report.samples = len(train)
    report.tokens = int(train.offsets[-1])
    report.target_tokens = int((train.labels != -100).sum())
    report.eval_samples = len(evaluation) if evaluation is not None else 0
    return train, evaluation, report
