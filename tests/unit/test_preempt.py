"""finetune/run/preempt.py: the signal notes, the ranks' agreement on them, and the resume command built from a rank's
argv. The runs (2 ranks signalled mid-step, a second signal during the save, the resumed loss curve):
tests/integration/test_preempt.py."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from finetune.run import preempt
from finetune.multinode.jobwatch import NO_RANK_THERE, signal_report
from finetune.dist import free_port
from finetune.prepare import parse_args

ARGS = ["--deepspeed", "ds_configs/zero3.json", "--config", "recipes/tiny.yaml", "train.max_steps=20"]


def test_the_first_signal_is_noted_a_later_one_counted_and_the_handlers_restored():
    before = {s: signal.getsignal(s) for s in preempt.SIGNALS}
    with preempt.watching():
        assert preempt.votes() == [0.0, 0.0]
        os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler before the next bytecode of this thread
        assert preempt.votes() == [0.0, 1.0]
        os.kill(os.getpid(), signal.SIGTERM)  # a second one, of another kind: noted as later, the vote stays
        os.kill(os.getpid(), signal.SIGTERM)
        assert preempt.votes() == [0.0, 1.0] and preempt.ignored() == 2
    assert {s: signal.getsignal(s) for s in preempt.SIGNALS} == before
    with preempt.watching():  # a later run starts with no note
        assert preempt.votes() == [0.0, 0.0] and preempt.ignored() == 0


def test_after_a_stop_signals_stay_ignored_until_restore_signals():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(preempt.Stopped) as stopped:
        with preempt.watching():
            os.kill(os.getpid(), signal.SIGTERM)
            raise preempt.Stopped(4, "by SIGTERM", preempt.ignored())
    assert str(stopped.value) == "stopped at step 4 by SIGTERM"
    os.kill(os.getpid(), signal.SIGTERM)  # the ranks are leaving with a saved run: this one must not kill
    assert preempt.ignored() == 1
    stopped.value.restore_signals()
    assert signal.getsignal(signal.SIGTERM) == before


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def run():
        with preempt.watching():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [signal.getsignal(signal.SIGTERM)]


@pytest.mark.parametrize("summed, name", [([0.0, 0.0], ""), ([0.0, 2.0], "SIGUSR1"), ([1.0, 0.0], "SIGTERM"),
                                          ([1.0, 3.0], "SIGTERM")])
def test_the_summed_votes_name_the_stopping_signal(summed, name):
    assert preempt.agreed(summed) == name


def test_stopped_line():
    assert preempt.stopped_line(7, "by SIGTERM", "zerotune train x") == \
        "stopped at step 7 by SIGTERM; resume with: zerotune train x"


def test_deepspeed_launched_rank_resumes_with_deepspeed_and_without_local_rank():
    args = ["--local_rank=1", *ARGS, "train.resume=runs/x/checkpoints/step_00000004", "train.output_dir=runs/old"]
    command = preempt.resume_command("finetune/main.py", args, "runs/tiny", {"WORLD_SIZE": "2", "LOCAL_SIZE": "2"})
    assert command == ("deepspeed --num_gpus 2 finetune/main.py --deepspeed ds_configs/zero3.json --config "
                       "recipes/tiny.yaml train.max_steps=20 train.output_dir=runs/tiny train.resume=auto")
    # What the user runs is what the rank parses: the same recipe, JSON and keys, and the run folder resumed.
    parsed = parse_args(shlex.split(command)[4:])
    assert (parsed.deepspeed, parsed.config, parsed.local_rank) == ("ds_configs/zero3.json", "recipes/tiny.yaml", None)
    assert parsed.overrides == ["train.max_steps=20", "train.output_dir=runs/tiny", "train.resume=auto"]


def test_local_rank_given_as_two_words_and_one_gpu():
    command = preempt.resume_command("finetune/main.py", ["--local_rank", "0", *ARGS], "runs/t", {"WORLD_SIZE": "1"})
    assert command.startswith("deepspeed --num_gpus 1 finetune/main.py --deepspeed ") and " 0 " not in command


def test_several_nodes_resume_through_zerotune_launch():
    env = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    command = preempt.resume_command("/repo/finetune/main.py", ["--local_rank=3", *ARGS], "/shared/run", env)
    assert command == ("zerotune launch --hostfile HOSTFILE -- --deepspeed ds_configs/zero3.json --config "
                       "recipes/tiny.yaml train.max_steps=20 train.output_dir=/shared/run train.resume=auto")


def test_zerotune_train_and_a_plain_single_process():
    assert preempt.resume_command("/venv/bin/zerotune", ARGS, "runs/t", {}).startswith("zerotune train --deepspeed ")
    assert preempt.resume_command("finetune/main.py", ARGS, "runs/t", {}).startswith("python finetune/main.py --deep")


def test_a_stop_at_ending_resumes_without_it_and_a_signal_keeps_it():
    args = [*ARGS, "train.stop_at=10", "data.path=my data.jsonl"]
    by_stop_at = shlex.split(preempt.resume_command("zerotune", args, "runs/t", {}, stop_at_ended=True))
    assert by_stop_at[-4:] == ["data.path=my data.jsonl", "train.output_dir=runs/t", "train.stop_at=0",
                               "train.resume=auto"]
    assert "train.stop_at=10" not in by_stop_at
    by_signal = shlex.split(preempt.resume_command("zerotune", args, "runs/t", {}))
    assert "train.stop_at=10" in by_signal and "train.stop_at=0" not in by_signal


def test_the_launcher_passes_a_signal_to_this_jobs_ranks_of_the_host_only(tmp_path):
    """finetune/multinode/jobwatch.py's snippet, run here as on a host: this job's rank of node 0 gets it; not its
    own worker (same environment), a rank of node 1 (two "hosts" on one machine), nor another job's rank."""
    from finetune.multinode.jobwatch import _FORWARD_SNIPPET

    code = ("import os, signal, subprocess, sys, time\n"
            "name, folder = sys.argv[1], sys.argv[2]\n"
            "signal.signal(signal.SIGUSR1, lambda *a: open(os.path.join(folder, 'got_' + name), 'w').close())\n"
            "if name == 'rank':\n"
            "    subprocess.Popen([sys.executable, '-c', sys.argv[3], 'worker', folder, ''])\n"
            "open(os.path.join(folder, 'ready_' + name), 'w').close()\n"
            "time.sleep(30)\n")
    port = free_port()  # no real job of this machine listens there: the snippet signals none of them
    job = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "CROSS_RANK": "0"}
    envs = {"rank": job, "node1": dict(job, RANK="1", CROSS_RANK="1"), "other": dict(job, MASTER_PORT=str(port + 1))}
    procs = [subprocess.Popen([sys.executable, "-c", code, name, str(tmp_path), code], env=dict(os.environ, **env),
                              start_new_session=True) for name, env in envs.items()]
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("ready_*"))) < 4:
            assert time.monotonic() < deadline, sorted(os.listdir(tmp_path))
            time.sleep(0.05)
        done = subprocess.run([sys.executable, "-c", _FORWARD_SNIPPET, "127.0.0.1", str(port),
                               str(int(signal.SIGUSR1)), "0"], capture_output=True, text=True, timeout=60)
        assert done.stdout.strip() == "1", done.stderr
        time.sleep(0.5)
        assert sorted(p.name for p in tmp_path.glob("got_*")) == ["got_rank"]
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)  # the rank's worker too
            p.wait()


def test_a_host_whose_ranks_had_ended_is_no_problem_once_another_host_was_signalled():
    """The ranks stop together, so a host reached after its ranks saved and left needs no warning; a host that could
    not be reached does, and so does every host when none was reached."""
    assert signal_report({"node1": "", "node2": NO_RANK_THERE}) == []
    assert signal_report({"node1": "", "node2": "ssh: connect to host node2 port 22: Connection refused"}) == [
        "zerotune launch: could not signal the ranks on node2 (ssh: connect to host node2 port 22: Connection refused)"]
    assert signal_report({"node1": NO_RANK_THERE, "node2": NO_RANK_THERE}) == [
        f"zerotune launch: could not signal the ranks on node1 ({NO_RANK_THERE})",
        f"zerotune launch: could not signal the ranks on node2 ({NO_RANK_THERE})"]
