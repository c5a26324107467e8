"""The tests' rank starter (tests/fixtures/zygote.py, through tests/helpers.py's run_ranks): a rank it forks from one
process that has imported torch, DeepSpeed, transformers and peft sees what a rank started as a fresh interpreter
sees, and the caller gets its output and exit status as from one. An environment that a library reads at import
(here OMP_NUM_THREADS) gets a starter of its own; a starter refuses a rank whose environment is not its own."""

import json
import os

import pytest

from tests.helpers import ROOT, loopback_env, run_ranks, zygote
from tests.fixtures.zygote import ALLOWED

PROBE = os.path.join(ROOT, "tests", "drivers", "rank_probe.py")
RANDOM = ("random", "numpy_random", "torch_seed", "torch_rand", "parent")  # differ from process to process


def _facts(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_a_forked_rank_sees_what_a_fresh_one_sees():
    forked, fresh = (_facts(run_ranks(2, PROBE, [], fork=fork, timeout=300).stdout) for fork in (True, False))
    assert all(_is_a_starter(f["parent"]) for f in forked) and [f["parent"] for f in fresh] == [os.getpid()] * 2
    for ranks in (forked, fresh):
        assert [f["rank"] for f in ranks] == ["0", "1"] and {f["all_reduce"] for f in ranks} == {3.0}
        for drawn in RANDOM[:-1]:  # each rank's generators start from its own seed, as in a fresh interpreter
            assert ranks[0][drawn] != ranks[1][drawn], drawn
    for a, b in zip(forked, fresh):
        assert {k: v for k, v in a.items() if k not in RANDOM} == {k: v for k, v in b.items() if k not in RANDOM}
    assert forked[0]["name"] == "__main__" and forked[0]["argv"] == [PROBE, "--local_rank=0"]
    assert forked[0]["script_folder"] == os.path.dirname(PROBE) and forked[0]["cwd"] == ROOT
    assert forked[0]["session_leader"] and forked[0]["threads_at_start"] == 1 and forked[0]["torch_threads"] == 1


@pytest.mark.parametrize("ending, codes, words", [("exit=3", [3, 3], "stderr of rank 1"),
                                                  ("raise", [1, 1], "RuntimeError: rank 1 raised on purpose")])
def test_a_forked_ranks_exit_status_and_output_reach_the_caller(ending, codes, words):
    with pytest.raises(AssertionError) as failed:
        run_ranks(2, PROBE, [ending], timeout=300)
    assert f"exit codes {codes}" in str(failed.value) and words in str(failed.value)
    assert '"rank": "0"' in str(failed.value) and '"rank": "1"' in str(failed.value)


def test_an_environment_read_at_import_gets_its_own_starter(tmp_path):
    env = loopback_env(OMP_NUM_THREADS="2")
    ranks = _facts(run_ranks(2, PROBE, [], env=env, timeout=300).stdout)
    assert all(_is_a_starter(f["parent"]) for f in ranks) and [f["torch_threads"] for f in ranks] == [2, 2]
    starter = zygote({k: v for k, v in env.items() if k not in ALLOWED})
    other = dict(env, RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="3")
    out = str(tmp_path / "out")
    assert starter.start([PROBE], other, ROOT, out, out) is None  # refused: the caller starts a fresh interpreter


def _is_a_starter(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"tests/fixtures/zygote.py" in f.read()
