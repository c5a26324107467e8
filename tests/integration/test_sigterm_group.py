"""A SIGTERM to the whole process group of a one-machine job, as `timeout` sends it, on 2 real ranks (CPU, gloo on
loopback, ZeRO-3 fp32, tiny model): the job saves the step it is in, prints the resume line and exits 0.

The job is `zerotune launch --hostfile hostfiles/localhost -- ...`, started in a process group of its own; once two
steps are in metrics.jsonl the group gets SIGTERM (os.killpg). Only `zerotune launch` is in that group: it runs
DeepSpeed's runner, launcher and ranks in a session of their own and passes the signal on to the ranks alone. A plain
`deepspeed --num_gpus 2 ...` cannot end so: its runner dies of the signal at once, with 143 (finetune/run/preempt.py
says why nothing in the ranks can change that). train.save_every=0, so the one checkpoint is the stop's. The resume
line's command then runs to two steps past the stop, and a straight run of the same arguments to that step ends by
train.stop_at: the two loss curves are equal bit for bit. A signal to one rank or to the launcher alone, and a second
signal during the save: tests/integration/test_preempt.py.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from finetune.checkpoint import MARKER, complete_checkpoints
from tests.fixtures.sshd_fixture import IsolatedNetwork
from tests.helpers import (ROOT, SMALL_VOCAB, TINY_RECIPE, ds_variant, free_port, loopback_env, run_two_ranks,
                           save_tiny_model, step_losses)

LINE = re.compile(r"^stopped at step (\d+) by (SIGTERM|train\.stop_at); resume with: (.+)$", re.M)
MORE_STEPS = 2
"""Steps the resumed run trains past the stop."""



def _job_processes(port: int) -> list[psutil.Process]:
    """The processes of the job whose MASTER_PORT is `port` (DeepSpeed's launcher and the ranks): only ours match."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("MASTER_PORT") == str(port) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sigterm_group")
    model = save_tiny_model(str(tmp / "model"))
    ds = ds_variant("zero3", str(tmp / "zero3.json"), bf16=False)
    common = ["--deepspeed", ds, "--config", TINY_RECIPE, f"model.path={model}", f"model.tokenizer={SMALL_VOCAB}",
              f"data.path={ROOT}/recipes/data/tiny_instruct.jsonl", "data.max_seq_len=128", "optim.warmup_steps=2",
              "train.max_steps=1000", "train.save_every=0", "train.sample_prompt=null", "train.export=false",
              "train.log_every=1"]
    out, port = str(tmp / "run"), free_port()
    cwd = tmp / "cwd"  # not the repository: what a user's job folder is
    cwd.mkdir()
    # The ranks' environment reaches them through the job's .deepspeed_env (loopback, CPU only; tests/helpers.py).
    env = loopback_env(HF_HUB_OFFLINE="1")
    # The checks of the hosts and the doctor's own small launch are not what this test tests (tests/integration/
    # test_launcher.py runs them).
    options = ["--hostfile", f"{ROOT}/hostfiles/localhost", "--master-port", str(port), "--skip-preflight",
               "--no-doctor"]
    with IsolatedNetwork() as net:  # a loopback-only network where permitted (nsenter execs: the pid is the launcher's)
        job = subprocess.Popen([*net.prefix, sys.executable, "-m", "finetune.cli", "launch", *options, "--", *common,
                                f"train.output_dir={out}"], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)  # a full pipe never blocks it
        reader.start()
        try:
            deadline = time.monotonic() + 240
            while len(step_losses(out)) < 2:
                assert job.poll() is None, "".join(lines)[-4000:]
                assert time.monotonic() < deadline, "no two steps in 240 s:\n" + "".join(lines)[-4000:]
                time.sleep(0.05)
            trained = len(step_losses(out))
            os.killpg(job.pid, signal.SIGTERM)  # what `timeout` sends: every process of the group
            code = job.wait(timeout=180)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            reader.join(timeout=10)
    left = _job_processes(port)
    for p in left:  # the assertion below names them; the test leaves nothing running
        p.kill()
    first = {"code": code, "log": "".join(lines), "trained": trained, "left": [p.pid for p in left],
             "checkpoints": complete_checkpoints(out), "losses": step_losses(out),
             "names": sorted(os.listdir(os.path.join(out, "checkpoints")))}
    line = LINE.search(first["log"])
    assert line, first["log"][-4000:]
    stopped, command = int(line[1]), shlex.split(line[3])
    end = stopped + MORE_STEPS
    # The resume line's arguments: after the script in DeepSpeed's command (one machine), after `--` in the launcher's.
    args = command[command.index("--") + 1:] if "--" in command else command[4:]
    resumed = {"codes": run_two_ranks(args + [f"train.stop_at={end}"], str(tmp / "resumed.log")),
               "losses": step_losses(out), "log": (tmp / "resumed.log0").read_text()}
    straight_out = str(tmp / "straight")
    straight = {"codes": run_two_ranks(common + [f"train.output_dir={straight_out}", f"train.stop_at={end}"],
                                    str(tmp / "straight.log")),
                "losses": step_losses(straight_out), "log": (tmp / "straight.log0").read_text()}
    return {"first": first, "stopped": stopped, "command": command, "args": args, "end": end, "out": out,
            "resumed": resumed, "straight": straight}


def test_a_sigterm_to_the_whole_group_ends_the_job_with_exit_0(runs):
    s = runs["first"]
    assert s["code"] == 0, s["log"][-4000:]
    assert "zerotune launch: SIGTERM: passed on to every rank" in s["log"] and "could not signal" not in s["log"]
    assert "zerotune launch: job stopped by SIGTERM, saved" in s["log"]
    assert s["left"] == []  # DeepSpeed's launcher and both ranks ended with the job


def test_the_step_the_ranks_were_in_is_saved_complete(runs):
    s, n = runs["first"], runs["stopped"]
    assert n >= s["trained"]  # the step in progress when the signal came, or a later one
    assert s["losses"][-1][0] == n and [step for step, _ in s["losses"]] == list(range(1, n + 1))
    assert [step for step, _ in s["checkpoints"]] == [n]  # train.save_every=0: the stop's save, no other
    assert s["names"] == [f"step_{n:08d}"]  # no half-written .tmp-step_ folder
    with open(os.path.join(s["checkpoints"][0][1], MARKER)) as f:
        assert json.load(f)["step"] == n


def test_rank_0_prints_the_resume_line_once(runs):
    s, command = runs["first"], runs["command"]
    assert len(LINE.findall(s["log"])) == 1
    assert f"train.output_dir={runs['out']}" in command and command[-1] == "train.resume=auto"
    assert not [a for a in command if a.startswith("--local_rank")]
    assert "train.max_steps=1000" in runs["args"] and "--deepspeed" in runs["args"]  # the user's arguments, as given


def test_the_resumed_run_continues_the_straight_loss_curve_bit_for_bit(runs):
    r, st, n, end = runs["resumed"], runs["straight"], runs["stopped"], runs["end"]
    assert r["codes"] == [0, 0], r["log"][-3000:]
    assert st["codes"] == [0, 0], st["log"][-3000:]
    assert re.search(rf"resumed from \S+step_{n:08d} at step {n}\n", r["log"]), r["log"][-3000:]
    assert [step for step, _ in st["losses"]] == list(range(1, end + 1))
    assert r["losses"] == st["losses"]  # the stopped run's steps, then the resumed run's: every loss equal
