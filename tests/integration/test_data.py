"""The dataset pipeline: tokenize-once cache (also across ranks), parallel tokenization, mixing, eval split,
over-long policy, clear errors for bad input, and the `zerotune preprocess` command (CPU, no network)."""

import json
from tests.fixtures.data_files import TINY_INSTRUCT, write_lines
from tests.helpers import run_ranks


def test_with_two_ranks_only_one_tokenizes(tmp_path):
    bad = write_lines(tmp_path / "bad.jsonl", ['{"instruction": "a", "output": "b"}', '{"instruction": "a"}'])
    run_ranks(2, "tests/drivers/data_cache_driver.py", [str(tmp_path), str(tmp_path / "cache"), TINY_INSTRUCT, bad], timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["built"] for r in ranks] == [[True, False], [False, False]]  # rank 0 builds, rank 1 reads; then both read
    assert ranks[0]["sha"] == ranks[1]["sha"] and ranks[0]["samples"] == 40
    assert f"{bad}:2: missing field 'output'" in ranks[0]["error"]
    assert "tokenizing failed on the first rank of a node" in ranks[1]["error"]  # stopped, not left waiting
