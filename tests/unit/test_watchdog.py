"""The stall watchdog's parts, in process or in one small child process (no training): the limit of `auto`, the
collective recorder and its test hook, the summary's verdicts (not responding, behind, missing, all waiting), a
watchdog that fires and exits with code 4 after writing its stacks and summary, the launcher naming a stalled rank's
host, and the recipe key. Its integration half, tests/integration/test_stall.py, stops a rank of a real run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from finetune.run import activity
from finetune.run import watchdog
from finetune.config import ConfigError, load_recipe
from finetune.multinode.jobwatch import JobWatch
from finetune.run.activity import ACTIVITY
from tests.helpers import ROOT


def test_the_limit_is_explicit_or_follows_the_step_time():
    assert watchdog.limit_s(12, [1.0], "forward") == 12.0
    assert watchdog.limit_s(0, [1.0], "forward") is None
    for setting in ("auto", None):
        assert watchdog.limit_s(setting, [], "forward") == watchdog.LONG_S  # before the first step
        assert watchdog.limit_s(setting, [2.0, 90.0, 3.0], "forward") == 300.0  # 10 x 3 + 60 is below the floor
        assert watchdog.limit_s(setting, [50.0, 40.0, 60.0], "backward") == 10 * 50.0 + 60
        assert watchdog.limit_s(setting, [50.0], "eval") == 560.0  # eval: each micro-batch is progress
        assert watchdog.limit_s(setting, [50.0], "save") == watchdog.LONG_S
    assert watchdog.beat_s(8) == pytest.approx(0.8) and watchdog.beat_s(1e4) == 10.0 and watchdog.beat_s(1) == 0.25


@pytest.fixture
def group():
    """A one-rank gloo process group in this process (no network: a HashStore)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    activity.uninstall()
    dist.destroy_process_group()


def test_the_recorder_notes_each_collective_and_puts_the_originals_back(group):
    original = dist.all_reduce
    ACTIVITY.reset()
    activity.install()
    assert dist.all_reduce is not original and dist.distributed_c10d.all_reduce is dist.all_reduce
    dist.all_reduce(torch.ones(2))
    assert (ACTIVITY.collective, ACTIVITY.state, ACTIVITY.issued) == ("all_reduce", "returned", 1)
    dist.all_reduce(torch.ones(2), async_op=True).wait()
    assert (ACTIVITY.state, ACTIVITY.issued) == ("async", 2)
    found = [None]
    dist.all_gather_object(found, {"a": 1})  # calls all_gather inside: recorded once, as the outer collective
    assert (ACTIVITY.collective, ACTIVITY.issued, found) == ("all_gather_object", 3, [{"a": 1}])
    with pytest.raises(Exception):
        dist.broadcast(torch.ones(2), src=5)  # no rank 5
    assert (ACTIVITY.collective, ACTIVITY.state) == ("broadcast", "raised")
    activity.uninstall()
    assert dist.all_reduce is original and dist.distributed_c10d.all_reduce is original


def test_the_test_hook_is_parsed_and_matched_on_its_rank_step_and_phase(monkeypatch):
    hook = activity._parse_hook("rank=1,step=3,in=all_reduce,phase=save")
    assert hook == {"rank": 1, "step": 3, "in": "all_reduce", "phase": "save"}
    for bad in ("rank=1,step=3", "rank=1,step=x,in=all_reduce", "rank=1,step=3,in=allreduce", "rank=1,step=3,in=barrier,at=2"):
        with pytest.raises(ValueError, match=r"ZEROTUNE_TEST_STALL=.*write rank=R,step=S,in=COLLECTIVE"):
            activity._parse_hook(bad)
    ACTIVITY.reset()
    ACTIVITY.start_step(3)
    ACTIVITY.mark("save")
    monkeypatch.setenv("RANK", "1")
    assert activity._hook_matches(hook, "all_reduce")
    assert not activity._hook_matches(hook, "barrier")
    ACTIVITY.mark("forward")
    assert not activity._hook_matches(hook, "all_reduce")
    assert activity._hook_matches(dict(hook, phase=None), "all_reduce")
    monkeypatch.setenv("RANK", "0")
    assert not activity._hook_matches(dict(hook, phase=None), "all_reduce")


def _beat(rank: int, beat: int, step=7, issued=100, phase="forward", collective="all_reduce", state="waiting"):
    return {"rank": rank, "world": 4, "host": f"node{rank // 2}", "pid": 1000 + rank, "beat": beat, "time": time.time(),
            "step": step, "done": step - 1, "micro": 0, "phase": phase, "phase_for_s": 12.0, "collective": collective,
            "state": state, "issued": issued, "idle_s": 30.0}


def _summary(first, second) -> str:
    return "\n".join(watchdog.summary(first, second, 0, "RUN/stall", 30, 30.0, 31.0))


def test_the_summary_names_a_rank_that_stopped_responding():
    first = [_beat(0, 5), _beat(1, 5), _beat(2, 9, phase="backward", collective="reduce_scatter_tensor"), _beat(3, 5)]
    second = [_beat(0, 8), _beat(1, 8), first[2], _beat(3, 8)]
    text = _summary(first, second)
    assert text.startswith("zerotune: error: stalled: no progress for 31 s (train.stall_timeout_s: 30) in step 7 "
                           "(the last finished: 6); every running rank wrote its Python stacks to RUN/stall/rank_<K>.txt "
                           "and exits with code 4\n")
    assert ("zerotune: stall: rank 2 (host node1, pid 1002) not responding, its heartbeat stopped 0 s ago; its last "
            "record: step 7, phase backward, micro-batch 0, in reduce_scatter_tensor (not returned); 12 s in this phase") in text
    assert ("zerotune: stall: waiting: ranks 0-1, 3: step 7, phase forward, micro-batch 0, in all_reduce (not "
            "returned)\n") in text
    assert "check first: rank 2's process on node1: `ps -o pid,stat,cmd -p 1002`" in text


def test_the_summary_names_a_rank_behind_a_missing_one_or_none():
    first = [_beat(0, 1), _beat(1, 1, issued=99, state="entered"), _beat(2, 1), None]
    second = [_beat(0, 2), _beat(1, 2, issued=99, state="entered"), _beat(2, 2), None]
    text = _summary(first, second)
    assert ("rank 1 (host node0, pid 1001) is behind (step 7, 99 collectives passed to the backend; the others are at "
            "step 7, 100): step 7, phase forward, micro-batch 0, entering all_reduce (not yet passed to the backend)") in text
    assert "rank 3: no heartbeat in RUN/stall (it ended, never started its watchdog, or output_dir is not shared" in text
    assert "check first: where rank 1 is: RUN/stall/rank_1.txt, or `py-spy dump --pid 1001` on node0" in text
    same = [_beat(k, 1) for k in range(2)], [_beat(k, 2) for k in range(2)]
    text = "\n".join(watchdog.summary(*same, 0, "RUN/stall", "auto", 560.0, 600.0))
    assert "(train.stall_timeout_s: auto, now 560 s)" in text
    assert "not responding" not in text and "behind" not in text
    assert "check first: every rank waits in all_reduce: the network between the hosts" in text


CHILD = """
import os, sys, time
sys.path.insert(0, {root!r})
from finetune.run import watchdog
from finetune.run.activity import ACTIVITY
dog = watchdog.Watchdog({out!r}, 1)
dog.start()
ACTIVITY.start_step(1)
ACTIVITY.mark("forward", 0)
time.sleep(30)
"""


def test_a_stalled_rank_writes_its_stacks_and_the_summary_then_exits_4(tmp_path):
    script = CHILD.format(root=ROOT, out=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, RANK="0", WORLD_SIZE="1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == watchdog.STALL_EXIT, done.stdout + done.stderr
    # At least the timeout; more on a loaded machine, where the watchdog's thread wakes late (it polls).
    stalled = re.match(r"zerotune: error: stalled: no progress for (\d+) s \(train.stall_timeout_s: 1\) in step 1 \(the "
                       r"last finished: none in this run\)", done.stderr)
    assert stalled and 1 <= int(stalled[1]) < 30, done.stderr
    assert re.search(r"zerotune: stall: waiting: rank 0 \(host \S+\): step 1, phase forward, micro-batch 0, no collective "
                     r"yet\n", done.stderr), done.stderr
    stall = tmp_path / "stall"
    assert (stall / "summary.txt").read_text() == done.stderr
    stacks = (stall / "rank_0.txt").read_text()
    assert "step 1, phase forward, micro-batch 0, no collective yet" in stacks
    assert "Python stacks of every thread" in stacks and 'line 10 in <module>' in stacks  # the sleeping main thread
    beat = json.loads((stall / "beat_rank_0.json").read_text())
    assert (beat["rank"], beat["step"], beat["phase"], beat["micro"]) == (0, 1, "forward", 0)


def test_a_watchdog_that_ends_leaves_nothing_and_puts_the_collectives_back(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    original = dist.all_reduce
    for setting, watched in ((5, True), (0, False)):
        with watchdog.watching(str(tmp_path), setting):
            ACTIVITY.mark("forward", 0)
            assert (dist.all_reduce is not original) == watched
            assert os.path.exists(tmp_path / "stall" / "beat_rank_0.json") == watched
        assert os.listdir(tmp_path) == [] and dist.all_reduce is original
    with pytest.raises(RuntimeError, match="boom"), watchdog.watching(str(tmp_path), 5):
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == [] and dist.all_reduce is original


def test_the_launcher_names_the_host_of_a_stalled_rank():
    watch = JobWatch({"127.0.0.1": [0], "127.0.0.2": [1]})
    line = ("127.0.0.1: zerotune: stall: rank 1 (host vm, pid 77) not responding, its heartbeat stopped 9 s ago; its "
            "last record: step 4, phase backward, micro-batch 0, in all_reduce (not returned); 1 s in this phase\n")
    assert str(watch.feed(line)) == ("rank 1 on 127.0.0.2 stalled: not responding, its heartbeat stopped 9 s ago; its "
                                     "last record: step 4, phase backward, micro-batch 0, in all_reduce (not returned); "
                                     "1 s in this phase")
    assert watch.feed("127.0.0.1: zerotune: stall: waiting: rank 0 (host vm): step 4\n") is None
    watch.feed("pdsh@vm: 127.0.0.1: ssh exited with exit code 4\n")
    assert watch.summary().startswith("rank 1 on 127.0.0.2 stalled: not responding")
    assert watch.summary().endswith("(after it: rank 0 on 127.0.0.1 exited with code 4)")


def test_the_recipe_key_takes_seconds_auto_or_null():
    for text, value in (("auto", "auto"), ("null", None), ("0", 0.0), ("12.5", 12.5)):
        assert load_recipe("tiny", [f"train.stall_timeout_s={text}"]).train.stall_timeout_s == value
    assert load_recipe("tiny").train.stall_timeout_s == "auto"
    with pytest.raises(ConfigError, match=r"train.stall_timeout_s must be >= 0 \(seconds; 0 = off\), or auto"):
        load_recipe("tiny", ["train.stall_timeout_s=-1"])
    with pytest.raises(ConfigError, match=r"train.stall_timeout_s must be a number or one of: auto; got 'soon'"):
        load_recipe("tiny", ["train.stall_timeout_s=soon"])
