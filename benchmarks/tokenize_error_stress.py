"""The tokenizer pool's error path, many times over: a file with one bad record tokenized on 2 workers, N rounds.
What it measures: whether any round hangs, and the slowest round's seconds. Each round must end with the bad line
named; a round that takes over HANG_S seconds is a hang, and every thread's stack is printed before the script exits
with code 1. A hang is rare, so this runs by hand, not in the suite (tests/unit/test_data.py checks one round and
that no worker is left); run it after changing finetune/data/cache.py's worker pool:

    python benchmarks/tokenize_error_stress.py 400    # prints: 400 rounds, each naming the bad line; the slowest ...
"""

import faulthandler
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for finetune and tests

HANG_S = 60


def main(rounds: int) -> None:
    import finetune.data.cache as cache
    from finetune.config import ConfigError, DataConfig
    from finetune.data import build_datasets
    from finetune.data.tokenizer import load_tokenizer
    from tests.helpers import SMALL_VOCAB

    cache.CHUNK_RECORDS = 4  # many chunks in flight around the bad one
    tok = load_tokenizer(SMALL_VOCAB)
    good = '{"instruction": "Hi", "output": "Hello"}'
    folder = tempfile.mkdtemp(prefix="tokenize-stress-")
    path = os.path.join(folder, "bad.jsonl")
    with open(path, "w") as f:
        f.write("\n".join([good] * 40 + ['{"instruction": "Hi", "output": 3}'] + [good] * 40) + "\n")
    slowest = 0.0
    for i in range(rounds):
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        start = time.monotonic()
        try:
            build_datasets(DataConfig(path=path, num_proc=2), tok, 42, os.path.join(folder, f"cache{i}"))
            sys.exit(f"round {i}: the bad record was not reported")
        except ConfigError as e:
            assert str(e).startswith(f"{path}:41: field 'output' must be string"), e
        faulthandler.cancel_dump_traceback_later()
        slowest = max(slowest, time.monotonic() - start)
    print(f"{rounds} rounds, each naming the bad line; the slowest took {slowest:.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
