"""Save on preemption (finetune/run/preempt.py) on 2 real ranks, CPU and gloo on loopback, ZeRO-3 fp32, tiny model.

Runs 1 and 2 go through `zerotune launch`: on two loopback "nodes" through pdsh where sshd and pdsh exist (as in
CI), else on this machine (hostfiles/localhost). max_steps is far away; a checkpoint every 3 steps, all kept.
Run 1: once step 3's checkpoint is complete, SIGTERM goes to rank 1 only, which is then inside step 4 (or 5); rank 0
learns of it through the step sums. When the stop's save has created its .tmp-step_ folder, both ranks get SIGTERM
again (as Slurm signals every process), which they ignore. The job exits 0, the checkpoint of the step the ranks
stopped after is complete, the one before it unchanged, and rank 0 printed `stopped at step N by SIGTERM; resume
with: ...`.
Run 2 is that line's command; a step after the resumed one, the launcher gets SIGUSR1 and passes it on to the ranks
(finetune/multinode/jobwatch.py), which stop and save again. Run 3 is the same training straight to that step,
ended by train.stop_at (with its own resume line): the loss curve of runs 1 and 2 equals it bit for bit.
The unit half: tests/unit/test_preempt.py.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import threading
import time

import pytest

from finetune.checkpoint import MARKER, complete_checkpoints
from tests.fixtures.sshd_fixture import missing_binaries
from tests.helpers import (ROOT, SMALL_VOCAB, TINY_RECIPE, ds_variant, free_port, run_two_ranks, save_tiny_model,
                           step_losses)
from tests.fixtures.launch_cluster import launch, rank_pid

# pdsh puts `host: ` before each line of a rank.
LINE = re.compile(r"^(?:\S+: )?stopped at step (\d+) by (SIGTERM|SIGUSR1|train\.stop_at); resume with: (.+)$", re.M)



def _wait(condition, job: subprocess.Popen, what: str, timeout: float = 240, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return found


def _hashes(folder: str) -> dict[str, str]:
    found = {}
    for path in sorted(glob.glob(os.path.join(folder, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return found


class _Job:
    """`zerotune launch` on the two pdsh "nodes" where they can be had, else on this machine; its output is read by
    a thread, so that a full pipe never holds the job up."""

    def __init__(self, request, cwd, args: list[str]):
        self.pdsh, self.port = not missing_binaries(), free_port()
        if self.pdsh:
            nodes = request.getfixturevalue("cluster")
            prefix, env = nodes.prefix, nodes.env()
            self.hostfile = request.getfixturevalue("hostfile")
        else:
            prefix, env = request.getfixturevalue("netns"), dict(os.environ, GLOO_SOCKET_IFNAME="lo")
            self.hostfile = f"{ROOT}/hostfiles/localhost"
        options = ["--hostfile", self.hostfile, "--master-port", str(self.port), "--skip-preflight"]  # its tests: test_launcher
        self.proc = launch(prefix, cwd, env, options, args)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def finish(self, timeout: float = 120) -> dict:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.reader.join(timeout=10)
        return {"code": code, "log": "".join(self.lines), "pdsh": self.pdsh}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("preempt")
    model = save_tiny_model(str(tmp / "model"))
    ds = ds_variant("zero3", str(tmp / "zero3.json"), bf16=False)
    common = ["--deepspeed", ds, "--config", TINY_RECIPE, f"model.path={model}", f"model.tokenizer={SMALL_VOCAB}",
              f"data.path={ROOT}/recipes/data/tiny_instruct.jsonl", "data.max_seq_len=128", "optim.warmup_steps=2",
              "train.max_steps=1000", "train.save_every=3", "train.keep_last=0", "train.sample_prompt=null",
              "train.export=false", "train.log_every=1"]
    out = str(tmp / "run")
    # Run 1: one rank signalled, then both during the save.
    job = _Job(request, tmp / "cwd", common + [f"train.output_dir={out}"])
    try:
        ranks = [rank_pid(job.port, rank, time.monotonic() + 240) for rank in (0, 1)]
        _wait(lambda: complete_checkpoints(out), job.proc, "step 3's checkpoint")
        before = {step: _hashes(path) for step, path in complete_checkpoints(out)}
        os.kill(ranks[1], signal.SIGTERM)
        saving = _wait(lambda: glob.glob(os.path.join(out, "checkpoints", ".tmp-step_*")), job.proc, "the stop's save",
                       timeout=60, poll=0.002)
        for pid in ranks:
            os.kill(pid, signal.SIGTERM)
    finally:
        first = job.finish()
    first.update(before=before, saving=saving, losses=step_losses(out),
                 after={step: _hashes(path) for step, path in complete_checkpoints(out)},
                 left=sorted(os.listdir(os.path.join(out, "checkpoints"))))
    line = LINE.search(first["log"])
    assert line, first["log"][-4000:]
    stopped, command = int(line[1]), shlex.split(line[3])
    # Run 2: the printed command (the launcher's, with the hostfile named; or DeepSpeed's on one node, whose arguments
    # the launcher takes after `--`); SIGUSR1 to the launcher once a step after the resumed one is done.
    args = command[command.index("--") + 1:] if "--" in command else command[4:]
    job = _Job(request, tmp / "cwd", args)
    try:
        _wait(lambda: [s for s, _ in step_losses(out) if s > stopped], job.proc, "a step after the resumed one")
        os.kill(job.proc.pid, signal.SIGUSR1)
    finally:
        second = job.finish()
    second["losses"] = step_losses(out)
    line = LINE.search(second["log"])
    assert line, second["log"][-4000:]
    end = int(line[1])
    # Run 3: straight to the same step.
    straight_out = str(tmp / "straight")
    codes = run_two_ranks(common + [f"train.output_dir={straight_out}", f"train.stop_at={end}"], str(tmp / "straight.log"))
    straight = {"codes": codes, "log": (tmp / "straight.log0").read_text(), "losses": step_losses(straight_out),
                "out": straight_out}
    return {"first": first, "stopped": stopped, "command": command, "second": second, "end": end, "out": out,
            "straight": straight}


def test_a_signal_to_one_rank_stops_both_after_the_same_step_saved(runs):
    s, n = runs["first"], runs["stopped"]
    assert s["code"] == 0, s["log"][-4000:]  # every rank exited 0: DeepSpeed's launch.py and pdsh report any other
    # Rank 1 was in step 4 (or about to start it, or in 5 on a slow machine) when signalled: that step is finished.
    assert n in (4, 5), s["log"][-3000:]
    assert s["losses"][-1][0] == n and len(s["losses"]) == n  # the last step recorded is the one saved
    assert f"step_{n:08d}" in s["left"] and not [d for d in s["left"] if d.startswith(".tmp-")]
    with open(os.path.join(runs["out"], "checkpoints", f"step_{n:08d}", MARKER)) as f:
        assert json.load(f)["step"] == n
    assert len(LINE.findall(s["log"])) == 1  # printed once, by rank 0
    assert "zerotune launch: job finished" in s["log"]  # the launcher itself was not signalled


def test_a_second_signal_during_the_save_leaves_the_previous_checkpoint_intact(runs):
    s, n = runs["first"], runs["stopped"]
    assert s["saving"] == [os.path.join(runs["out"], "checkpoints", f".tmp-step_{n:08d}")]
    assert s["code"] == 0
    assert max(s["before"]) == 3
    assert s["after"][3] == s["before"][3]  # every file of the previous checkpoint, byte for byte
    assert sorted(s["after"]) == [3, n]


def test_the_resume_line_names_the_run_folder_and_resume_auto(runs):
    command = runs["command"]
    # Two nodes: the launcher's command (the hostfile is the user's to name); one: DeepSpeed's, with the script as run.
    start = ["zerotune", "launch", "--hostfile", "HOSTFILE", "--"] if runs["first"]["pdsh"] else \
        ["deepspeed", "--num_gpus", "2", os.path.join(ROOT, "finetune", "main.py")]
    assert command[:len(start)] == start, command
    assert f"train.output_dir={runs['out']}" in command and command[-1] == "train.resume=auto"
    assert not [a for a in command if a.startswith("--local_rank")]
    assert "train.max_steps=1000" in command and "--deepspeed" in command  # the user's arguments, as given


def test_the_launcher_passes_sigusr1_on_to_every_rank(runs):
    s, n, end = runs["second"], runs["stopped"], runs["end"]
    assert s["code"] == 0, s["log"][-4000:]
    assert re.search(rf"resumed from \S+step_{n:08d} at step {n}\n", s["log"])
    assert "zerotune launch: SIGUSR1: passed on to every rank" in s["log"] and "could not signal" not in s["log"]
    assert f"stopped at step {end} by SIGUSR1; resume with: " in s["log"] and end > n
    assert "zerotune launch: job stopped by SIGUSR1, saved" in s["log"]
    assert end in [step for step, _ in complete_checkpoints(runs["out"])]


def test_the_resumed_runs_continue_the_straight_loss_curve_bit_for_bit(runs):
    st, end = runs["straight"], runs["end"]
    assert st["codes"] == [0, 0], st["log"][-3000:]
    assert [s for s, _ in st["losses"]] == list(range(1, end + 1))
    assert runs["second"]["losses"] == st["losses"]


def test_train_stop_at_prints_the_same_resume_line(runs):
    st, end = runs["straight"], runs["end"]
    line = LINE.search(st["log"])
    assert line and (int(line[1]), line[2]) == (end, "train.stop_at"), st["log"][-2000:]
    command = shlex.split(line[3])
    assert command[-3:] == [f"train.output_dir={st['out']}", "train.stop_at=0", "train.resume=auto"]
    assert not [a for a in command[:-3] if a.startswith("train.stop_at=")]
