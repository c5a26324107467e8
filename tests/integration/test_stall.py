"""The stall watchdog (finetune/run/watchdog.py) on real ranks, CPU and gloo on loopback, train.stall_timeout_s=8.

Run 1: rank 1 of 2 stopped with SIGSTOP after a checkpoint ends the run within the timeout + 30 s: the running rank
exits with code 4, its stack file written, its summary naming the stopped rank and the phase of that rank's last
record. Where sshd and pdsh exist (as in CI) run 1 goes through the two-"node" pdsh launch, whose `job failed:` line
names the stopped rank's host; elsewhere its ranks are started here. Run 2 resumes run 1's checkpoint
(train.resume=auto) and meets the test hook (ZEROTUNE_TEST_STALL: rank 1 sleeps inside a collective during a save):
named with that collective, the save leaving only its .tmp- folder. The unit half: tests/unit/test_watchdog.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest

from finetune.checkpoint import complete_checkpoints
from tests.fixtures.sshd_fixture import missing_binaries
from tests.helpers import ROOT, SMALL_VOCAB, free_port, loopback_env, save_tiny_model, start_ranks
from tests.fixtures.launch_cluster import has_port, launch, rank_pid, tiny_args

TIMEOUT_S = 8
# As tests/fixtures/launch_cluster.py's tiny_args, which the pdsh run uses.
ARGS = ["--deepspeed", os.path.join(ROOT, "ds_configs", "zero3.json"), "--config", os.path.join(ROOT, "recipes", "tiny.yaml"),
        f"model.tokenizer={SMALL_VOCAB}", f"data.path={ROOT}/recipes/data/tiny_instruct.jsonl", "train.sample_prompt=null",
        "train.log_every=1"]
PHASES = "data|forward|backward|optimizer step|step sums|eval|save"


def _spawn(world: int, args: list[str], logs, **env: str) -> list:
    """`world` ranks of finetune/main.py started as DeepSpeed's launcher would (tests/helpers.py start_ranks), left
    running: the test stops, watches and kills them itself."""
    logs = [str(logs / f"rank{rank}.log") for rank in range(world)]
    return start_ranks(world, "finetune/main.py", args, loopback_env(MASTER_PORT=str(free_port()), **env),
                       [(log, log) for log in logs])


def _end(procs: list) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGCONT)  # a stopped process takes its SIGKILL once continued
        p.wait()


def _beat(out, rank: int) -> dict:
    try:
        with open(os.path.join(out, "stall", f"beat_rank_{rank}.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _stop_after_a_checkpoint(out, pid: int, running, deadline: float) -> tuple[float, dict]:
    """SIGSTOP `pid` (rank 1) once a checkpoint is complete and its heartbeat shows a later step; returns when and
    the heartbeat it had written."""
    while not (complete_checkpoints(str(out)) and _beat(out, 1).get("done", 0) >= 3):
        assert running() and time.monotonic() < deadline, "the run ended or never saved a checkpoint"
        time.sleep(0.1)
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic(), _beat(out, 1)


def _pdsh_run(request, out, args: list[str]) -> dict:
    """Run 1 through `zerotune launch` on the two loopback "nodes" (tests/integration/conftest.py's sshd)."""
    nodes, hosts = request.getfixturevalue("cluster"), request.getfixturevalue("hostfile")
    port, cwd = free_port(), out.parent / "cwd"
    options = ["--hostfile", hosts, "--master-port", str(port), "--failure-grace", "3"]
    proc = launch(nodes.prefix, cwd, nodes.env(), options, tiny_args(str(out), 10_000) + args)
    pid = None
    try:
        deadline = time.monotonic() + 240
        pid = rank_pid(port, 1, deadline)
        stopped_at, frozen = _stop_after_a_checkpoint(out, pid, lambda: proc.poll() is None, deadline)
        log = proc.communicate(timeout=TIMEOUT_S + 60)[0]
        seconds = time.monotonic() - stopped_at
    finally:
        if pid is not None and psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    # Rank 0's exit code: pdsh's line for its host, or, where the launcher stopped pdsh before it printed that line,
    # the line of DeepSpeed's launcher on that host, which reports the rank's own code.
    code = (re.search(r"127\.0\.0\.1: ssh exited with exit code (\d+)", log)
            or re.search(r"127\.0\.0\.1: .*\[launch\.py:\d+:sigkill_handler\] .* exits with return code = (\d+)", log))
    left = [p for p in psutil.process_iter() if has_port(p, port)]
    return {"pdsh": True, "seconds": seconds, "code": int(code[1]) if code else None, "job_code": proc.returncode,
            "pid": pid, "frozen": frozen, "log": log, "left_behind": left}


def _direct_run(tmp, out, args: list[str]) -> dict:
    """Run 1 with its two ranks started here (no sshd or pdsh on this machine)."""
    procs = _spawn(2, args + ["train.max_steps=10000"], tmp, ZEROTUNE_TEST_STALL="")
    try:
        stopped_at, frozen = _stop_after_a_checkpoint(out, procs[1].pid, lambda: procs[0].poll() is None,
                                                      time.monotonic() + 240)
        procs[0].wait(timeout=TIMEOUT_S + 60)
        seconds = time.monotonic() - stopped_at
    finally:
        _end(procs)
    return {"pdsh": False, "seconds": seconds, "code": procs[0].returncode, "pid": procs[1].pid, "frozen": frozen,
            "log": (tmp / "rank0.log").read_text()}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Run 1: rank 1 stopped with SIGSTOP after a checkpoint, through the two-"node" pdsh launch where sshd and pdsh
    exist (as in CI; one launch proves both), else started directly. Run 2: run 1's folder resumed, its rank 1
    sleeping in the first all_reduce of the save of the second step after the resumed one."""
    tmp = tmp_path_factory.mktemp("stall")
    model, out = save_tiny_model(str(tmp / "model")), tmp / "run"
    args = [f"model.path={model}", f"train.output_dir={out}", "train.save_every=2", "train.export=false",
            f"train.stall_timeout_s={TIMEOUT_S}"]
    pdsh = not missing_binaries()
    first = _pdsh_run(request, out, args) if pdsh else _direct_run(tmp, out, ARGS + args)
    first["stall_files"] = sorted(os.listdir(out / "stall"))
    first["stack"] = (out / "stall" / "rank_0.txt").read_text()
    first["summary"] = (out / "stall" / "summary.txt").read_text()
    resumed = complete_checkpoints(str(out))[-1][0]
    hook = f"rank=1,step={resumed + 2},in=all_reduce,phase=save"
    procs = _spawn(2, ARGS + args + ["train.resume=auto", f"train.max_steps={resumed + 4}", "train.save_every=1"], tmp,
                   ZEROTUNE_TEST_STALL=hook)
    try:
        procs[0].wait(timeout=240)
        second = {"codes": [p.wait(timeout=60) for p in procs], "resumed": resumed,
                  "log": (tmp / "rank0.log").read_text() + (tmp / "rank1.log").read_text(),
                  "checkpoints": sorted(os.listdir(out / "checkpoints"))}
    finally:
        _end(procs)
    return first, second


def test_stopped_rank_ends_the_run_named_with_its_phase(runs):
    first, _ = runs
    log = first["log"]
    assert first["code"] == 4, log[-4000:]
    assert first["seconds"] < TIMEOUT_S + 30
    # One summary, from the running rank, naming the stopped one and what its last heartbeat recorded.
    assert log.count("zerotune: error: stalled: no progress for") == 1, log[-4000:]
    assert all(line in log for line in first["summary"].splitlines())
    frozen = first["frozen"]
    named = re.search(rf"zerotune: stall: rank 1 \(host \S+, pid {first['pid']}\) not responding, its heartbeat "
                      rf"stopped \d+ s ago; its last record: step (\d+), phase ({PHASES})\b", log)
    assert named, log[-4000:]
    assert (int(named[1]), named[2]) == (frozen["step"], frozen["phase"])
    assert f"check first: rank 1's process on {frozen['host']}: `ps -o pid,stat,cmd -p {first['pid']}`" in log
    # The running rank's stacks; none from the stopped one, which could not write them.
    assert "rank_0.txt" in first["stall_files"] and "rank_1.txt" not in first["stall_files"]
    assert "Python stacks of every thread" in first["stack"] and 'finetune/train.py", line' in first["stack"]


def test_checkpoint_resumes_and_a_rank_asleep_in_a_collective_is_named(runs):
    _, second = runs
    resumed, log = second["resumed"], second["log"]
    assert second["codes"] == [4, 4], log[-4000:]
    assert re.search(rf"resumed from \S+step_{resumed:08d} at step {resumed}\n", log), log[-4000:]
    assert re.search(rf"zerotune: stall: rank 1 \(host \S+, pid \d+\) is behind .*: step {resumed + 2}, phase save, "
                     r"entering all_reduce \(not yet passed to the backend\)", log), log[-4000:]
    assert re.search(rf"waiting: rank 0 \(host \S+\): step {resumed + 2}, phase save, in all_reduce \(not returned\)", log)
    # The save that stalled left its .tmp- folder only; the one before it is complete.
    assert f".tmp-step_{resumed + 2:08d}" in second["checkpoints"]
    assert f"step_{resumed + 2:08d}" not in second["checkpoints"]
    assert f"step_{resumed + 1:08d}" in second["checkpoints"]


def test_two_nodes_name_the_stopped_rank_and_its_host(runs):
    first, _ = runs
    if not first["pdsh"]:
        pytest.skip(f"two-node runs need {', '.join(missing_binaries())} (apt-get install openssh-server pdsh openmpi-bin)")
    assert first["job_code"] != 0
    assert re.search(rf"job failed: rank 1 on 127\.0\.0\.2 stalled: not responding, .*phase {first['frozen']['phase']}\b",
                     first["log"]), first["log"][-4000:]
    assert not first["left_behind"], "ranks left behind"
