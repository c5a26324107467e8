"""Tokenization throughput of the real data pipeline (build_datasets: read, template, tokenize, cache) per data.num_proc.

    python benchmarks/preprocess_speed.py --records 20000 --num-proc 1,2 --out preprocess_speed.json

Generates a `messages` corpus with recipes/data/make_sample_chat.py (or reads --input), builds each num_proc into a
fresh cache and prints records, tokens, seconds, tokens/s and tokens/s per worker process. Not a timed test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GOAL_PER_CORE = 50_000  # tokens/s per core that the data pipeline aims for


def write_corpus(path: str, records: int, seed: int) -> None:
    spec = importlib.util.spec_from_file_location("make_sample_chat", os.path.join(ROOT, "recipes", "data", "make_sample_chat.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    with open(path, "w", encoding="utf-8") as f:
        for record in generator.conversations(records, seed):
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def measure(path: str, fmt: str, num_proc: int, max_seq_len: int, tokenizer) -> dict:
    from finetune.config import DataConfig
    from finetune.data import build_datasets

    cfg = DataConfig(path=path, format=fmt, max_seq_len=max_seq_len, num_proc=num_proc, overlong="truncate")
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        _, _, report = build_datasets(cfg, tokenizer, 0, cache)
        seconds = time.perf_counter() - start
    assert report.built_cache, "a fresh cache directory must be built"
    procs = max(num_proc, 1)
    return {"num_proc": procs, "samples": report.samples, "tokens": report.tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(report.tokens / seconds), "tokens_per_s_per_core": round(report.tokens / seconds / procs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", help="an existing data file (default: generate a messages corpus)")
    p.add_argument("--format", default="messages", help="data.format of --input")
    p.add_argument("--records", type=int, default=20000, help="conversations to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-proc", default="1,2", help="comma-separated data.num_proc values")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--tokenizer", default="mistral-common")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    args = p.parse_args()

    import finetune.data.loader  # noqa: F401  (imports torch once, outside the timed region)
    from finetune.data.sources import read_raw
    from finetune.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.input
        if path is None:
            path = os.path.join(tmp, "corpus.jsonl")
            write_corpus(path, args.records, args.seed)
        records = sum(1 for _ in read_raw(path))
        results = [dict(records=records, **measure(path, args.format, int(n), args.max_seq_len, tokenizer))
                   for n in args.num_proc.split(",")]
        size = os.path.getsize(path)

    print(f"corpus: {records:,} records, {size / 1e6:.1f} MB ({args.input or 'generated'}); {os.cpu_count()} CPUs visible")
    print(f"{'num_proc':>8} {'records':>9} {'tokens':>11} {'seconds':>8} {'tokens/s':>11} {'tokens/s/core':>14}")
    for r in results:
        print(f"{r['num_proc']:>8} {r['records']:>9,} {r['tokens']:>11,} {r['seconds']:>8.2f} "
              f"{r['tokens_per_s']:>11,} {r['tokens_per_s_per_core']:>14,}")
    best = max(r["tokens_per_s_per_core"] for r in results)
    print(f"goal >= {GOAL_PER_CORE:,} tokens/s per core: {'met' if best >= GOAL_PER_CORE else 'NOT met'} (best {best:,})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"corpus": {"records": records, "bytes": size, "input": args.input, "format": args.format},
                       "cpus": os.cpu_count(), "goal_tokens_per_s_per_core": GOAL_PER_CORE, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
