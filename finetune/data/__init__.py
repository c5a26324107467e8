"""Records -> plugin -> input_ids/labels -> tokenized cache -> eval split and mixing: the datasets of a run.

    train, evaluation, report = build_datasets(recipe.data, tokenizer, seed=42, cache_dir="runs/x/.cache")

Plugins (finetune/data/formats.py, or a module named in data.plugins) see one record at a time and never
ranks, padding or samplers; the loader (finetune/data/loader.py) is the one place where ranks meet data.
"""

from __future__ import annotations

import os

import numpy as np

from finetune.config import ConfigError, DataConfig
from finetune.data import formats  # noqa: F401  (importing it registers the built-in formats)
from finetune.data.cache import DataReport, ReportedElsewhere, load_or_tokenize
from finetune.data.mix import concat, split_eval, weighted
from finetune.data.registry import get_format, load_plugins
from finetune.data.samples import TokenizedData
from finetune.data.sources import DataError, Source, parse_mix

__all__ = ["DataError", "DataReport", "ReportedElsewhere", "build_datasets", "resolve_sources"]


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """data.path (weight 1) plus data.mix, checked on every rank before anything is tokenized."""
    if cfg.num_proc < 0:
        raise ConfigError(f"data.num_proc must be >= 0 (0 or 1 tokenize in this process), got {cfg.num_proc}")
    try:
        load_plugins(cfg.plugins)
    except ImportError as e:
        raise ConfigError(str(e)) from None
    for key, path in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"{key}: data file {path!r} not found: set {key} to a local file or folder")
    sources = [Source(cfg.path, 1.0, cfg.format, "data.format")] + parse_mix(cfg.mix, cfg.format)
    for source in sources:
        try:
            get_format(source.format)
        except ValueError as e:
            raise ConfigError(f"{source.entry}: {e}") from None
    return sources


def build_datasets(cfg: DataConfig, tokenizer, seed: int, cache_dir: str) -> tuple[TokenizedData, TokenizedData | None, DataReport]:
    """(train, eval or None, report): every source tokenized once into the cache, eval held out, then mixed.

    With data.eval_fraction, each source's held-out samples are chosen before weighting, so no repeated copy
    of an eval sample is trained on. Preference data (format preference) is paired, and then every source must be;
    the report counts pairs.
    """
    sources = resolve_sources(cfg)
    report = DataReport()
    train_parts, eval_parts, names = [], [], []
    for k, source in enumerate(sources):
        data = load_or_tokenize(source.path, cfg, tokenizer, cache_dir, report, source.format)
        if not cfg.eval_path and cfg.eval_fraction > 0:
            data, held = split_eval(data, cfg.eval_fraction, seed, source=k)
            eval_parts.append(held)
        used = weighted(data, source.weight, seed, k)
        if len(used) == 0:
            report.notes.append(f"{source.entry} contributes no {'pairs' if data.paired else 'samples'} "
                                f"(weight {source.weight:g} x {data.units})")
        report.sources.append({"path": source.path, "format": source.format, "weight": source.weight,
                               "samples": data.units, "used": used.units})
        train_parts.append(used)
        names.append(f"{source.path} (format {source.format})")
    train = concat(train_parts, names)
    evaluation = None
    if cfg.eval_path:
        evaluation = load_or_tokenize(cfg.eval_path, cfg, tokenizer, cache_dir, report)
    elif eval_parts:
        evaluation = concat(eval_parts, names)
    report.paired = train.paired
    report.samples = train.units
    report.tokens = int(train.offsets[-1])
    report.target_tokens = int((np.asarray(train.labels) != -100).sum())
    report.eval_samples = evaluation.units if evaluation is not None else 0
    return train, evaluation, report
