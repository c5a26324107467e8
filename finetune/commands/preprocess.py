"""`zerotune preprocess`: tokenize a recipe's data into the cache and report samples, tokens, drops and pack fill.

    zerotune preprocess --config recipes/tiny.yaml --show 2 --dump /tmp/samples.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from finetune.config import ConfigError, load_recipe
from finetune.data import build_datasets
from finetune.data.tokenizer import load_tokenizer
from finetune.run import console


def pack_fill(data, capacity: int, packing: bool) -> tuple[int, float]:
    """(rows, fraction of row capacity holding real tokens) for one epoch. Without packing a row holds one unit (a
    sample, or of paired data a whole pair: chosen + rejected), so the width is the longest unit's."""
    from finetune.data.loader import epoch_rows  # lazy: the loader imports torch; `--help` and errors do without

    rows = epoch_rows(data, capacity, packing, shuffle=False, seed=0, epoch=0)
    units = data.lengths[0::2] + data.lengths[1::2] if data.paired else data.lengths
    width = capacity if packing else int(units.max())
    return len(rows), float(data.offsets[-1]) / (len(rows) * width)


def show_sample(data, index: int, tokenizer) -> str:
    """A sample's text with the trained tokens in [[double brackets]] (</s> marks a trained EOS)."""
    ids, labels = data.sample(index)
    out = []
    pairs = zip(ids.tolist(), labels.tolist())
    for trained, group in itertools.groupby(pairs, key=lambda pair: pair[1] != -100):
        tokens = [token for token, _ in group]
        text = tokenizer.decode([t for t in tokens if t not in (tokenizer.bos_id, tokenizer.eos_id)])
        text = ("<s>" if tokens[0] == tokenizer.bos_id else "") + text + ("</s>" if tokens[-1] == tokenizer.eos_id else "")
        out.append(f"[[{text}]]" if trained else text)
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML recipe")
    p.add_argument("--show", type=int, default=0, metavar="N", help="print N samples with trained tokens in [[...]]")
    p.add_argument("--dump", metavar="FILE.jsonl", help='write {"input_ids": [...], "labels": [...]} per training sample')
    p.add_argument("--cache-dir", default=None, help="default: <train.output_dir>/.cache, as training uses")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    try:
        recipe = load_recipe(args.config, args.overrides)
        tokenizer = load_tokenizer(recipe.model.tokenizer or recipe.model.path)
        cache_dir = args.cache_dir or os.path.join(recipe.train.output_dir, ".cache")
        train, evaluation, report = build_datasets(recipe.data, tokenizer, recipe.train.seed, cache_dir)
    except (ConfigError, FileNotFoundError) as e:
        console.error(e)
        return 2
    data = recipe.data
    rows, fill = pack_fill(train, data.max_seq_len, data.packing)
    print(report.summary())
    if data.packing:
        print(f"{rows:,} rows of {data.max_seq_len} tokens per epoch, pack fill {100 * fill:.1f}%")
    else:
        unit = "pair" if train.paired else "sample"
        print(f"{rows:,} rows per epoch (data.packing=false: one {unit} per row), "
              f"pack fill {100 * fill:.1f}% of rows as long as the longest {unit}")
    if report.built_cache:
        procs = f"{data.num_proc} processes" if data.num_proc > 1 else "1 process"
        rate = report.tokenized_tokens / max(report.tokenize_seconds, 1e-9)
        print(f"tokenized {report.tokenized_tokens:,} tokens in {report.tokenize_seconds:.2f} s on {procs} "
              f"({rate:,.0f} tokens/s), cache {cache_dir}")
    else:
        print(f"read from the cache {cache_dir} (nothing changed since it was built)")
    for i in range(min(args.show, len(train))):
        print(f"--- sample {i}\n{show_sample(train, i, tokenizer)}")
    if args.dump:
        with open(args.dump, "w") as f:
            for i in range(len(train)):
                ids, labels = train.sample(i)
                f.write(json.dumps({"input_ids": ids.tolist(), "labels": labels.tolist()}) + "\n")
        print(f"wrote {len(train):,} samples to {args.dump}")
    return 0
