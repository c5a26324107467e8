"""Each rank builds the same datasets twice, then from a broken file, and writes what happened (tests/integration/test_data.py).

    deepspeed --num_gpus 2 --master_addr 127.0.0.1 tests/drivers/data_cache_driver.py OUT_DIR CACHE_DIR DATA.jsonl BAD.jsonl
"""

import hashlib
import json
import os
import sys

from tests.helpers import skip_shm_build

skip_shm_build()

from finetune import dist  # noqa: E402
from finetune.config import ConfigError, DataConfig  # noqa: E402
from finetune.data import build_datasets  # noqa: E402
from finetune.data.tokenizer import load_tokenizer  # noqa: E402


def main(out_dir: str, cache_dir: str, data: str, bad: str) -> None:
    dist.init()
    tok = load_tokenizer("mistral-common")
    cfg = DataConfig(path=data, format="alpaca", max_seq_len=256)
    result = {"rank": dist.rank(), "local_rank": dist.local_rank(), "built": []}
    for _ in range(2):
        train, _, report = build_datasets(cfg, tok, 42, cache_dir)
        result["built"].append(report.built_cache)
        result["samples"] = len(train)
        result["sha"] = hashlib.sha256(train.input_ids.tobytes() + train.labels.tobytes()).hexdigest()
    try:  # a bad record: rank 0 raises its ConfigError, the other rank must stop too instead of waiting
        build_datasets(DataConfig(path=bad, format="alpaca", max_seq_len=256), tok, 42, cache_dir)
    except ConfigError as e:
        result["error"] = str(e)
    with open(os.path.join(out_dir, f"rank{dist.rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(*args)
    dist.shutdown()
    dist.exit_process(0)
