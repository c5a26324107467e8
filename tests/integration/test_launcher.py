"""The hostfile launcher (finetune/multinode/launcher.py, hostfile.py, preflight.py).

Unit, seconds: hostfile errors, filters, Slurm node lists, golden dry runs for 1, 2 and 4 hosts (pdsh, OpenMPI,
Slurm), .deepspeed_env merging, failure parsing, and a preflight that names unreachable hosts within 10 s.
Real runs, about 2 minutes: a private sshd makes 127.0.0.1 and 127.0.0.2 two "nodes"; the tiny recipe on 2 nodes x 1
slot through pdsh and through OpenMPI gives the losses of a single-node 2-process run; a rank killed mid-run ends
the job within 60 s naming it; a survivor that hangs is stopped by the launcher's watchdog; `--doctor` prints bus
bandwidth and latency per node and names a node whose sshd is down; the pdsh run is preceded by the quick doctor
(tests/unit/test_doctor.py holds the doctor's unit half). Loopback only.

    ZEROTUNE_UPDATE_GOLDEN=1 pytest tests/unit/test_launcher.py -k golden    # rewrite tests/fixtures/golden/launch/*.txt"""

from __future__ import annotations
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import psutil
import pytest
from tests.fixtures.launch_args import TRAIN_ARGS
from tests.fixtures.launch_cluster import has_port, launch, rank_pid, tiny_args
from tests.fixtures.sshd_fixture import free_port, missing_binaries, write_ssh_wrapper
from tests.helpers import ROOT


PROBE = os.path.join(ROOT, "tests", "drivers", "launch_probe.py")


def test_preflight_names_unreachable_hosts_within_10s(tmp_path):
    if missing_binaries(("ssh",)):
        pytest.skip("needs the ssh client")
    with socket.socket() as silent:  # accepts TCP connections but never speaks SSH: a hung host
        silent.bind(("127.0.0.4", 0))
        silent.listen(8)
        aliases = {"deadnode": ("127.0.0.3", free_port("127.0.0.3")), "silentnode": silent.getsockname()}
        bin_dir = write_ssh_wrapper(str(tmp_path), aliases)
        (tmp_path / "hosts").write_text("deadnode slots=1\nsilentnode slots=1\n")
        env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], PYTHONPATH=ROOT)
        os.makedirs(tmp_path / "cwd")
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "finetune.multinode.launcher", "--hostfile", str(tmp_path / "hosts"), "--", *TRAIN_ARGS,
             f"train.output_dir={tmp_path}/out"],
            env=env, cwd=tmp_path / "cwd", capture_output=True, text=True, timeout=60,
        )
        elapsed = time.monotonic() - start
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 10, f"preflight took {elapsed:.1f} s"
    assert re.search(r"FAIL deadnode reach: ssh failed: .*Connection refused", done.stdout), done.stdout
    assert re.search(r"FAIL silentnode reach: ssh failed: .*(timed out|banner)", done.stdout), done.stdout
    assert "nothing was started" in done.stderr
    assert "cmd =" not in done.stdout and os.listdir(tmp_path / "cwd") == [], "no runner, no .deepspeed_env"


def losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


@pytest.fixture(scope="module")
def single_node_losses(tmp_path_factory, netns):
    tmp = tmp_path_factory.mktemp("single")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    options = ["--hostfile", f"{ROOT}/hostfiles/localhost"]
    proc = launch(netns, tmp / "cwd", env, options, tiny_args(str(tmp / "out"), 10))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    return losses(str(tmp / "out"))


@pytest.mark.parametrize("backend", ["pdsh", "openmpi"])
def test_two_nodes_match_single_node(backend, cluster, hostfile, single_node_losses, tmp_path):
    out = str(tmp_path / "out")
    options = ["--hostfile", hostfile, "--launcher", backend]
    checkout_before = _git_status()
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, tiny_args(out, 10), doctor=backend == "pdsh")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    if backend == "pdsh":  # the quick doctor run, then training on the same master port
        assert re.search(r"^127.0.0.2 +1 +\d+\.\d\d +\d+\.\d\d .*gloo tcp \(lo\)$", output, re.M), output[-4000:]
        assert output.index("\ndoctor: ok\n") < output.index("zerotune launch: job finished")
    assert re.search(r"127.0.0.1 +ok .*ok, shared +free", output), output
    assert re.search(r"127.0.0.2 +ok .*ok, shared +-", output), output
    assert "--master_addr 127.0.0.1" in output and "zerotune launch: job finished" in output
    two_nodes = losses(out)
    assert len(two_nodes) == len(single_node_losses) == 10
    assert two_nodes == pytest.approx(single_node_losses, rel=1e-5)
    env_file = output.split(".deepspeed_env:\n", 1)[1]  # as printed; the file itself was in a temporary folder
    for line in ("GLOO_SOCKET_IFNAME=lo", f"PYTHONPATH={ROOT}", "TORCH_EXTENSIONS_DIR="):
        assert line in env_file
    # The launch leaves nothing behind: not in the folder it ran from, not in the checkout, not in the temp folder.
    assert os.listdir(tmp_path / "cwd") == [] and not os.path.exists(os.path.join(ROOT, ".deepspeed_env"))
    assert _git_status() == checkout_before
    env_path = re.search(r"DS_ENV_FILE=(\S+)", output).group(1)
    assert env_path.endswith("/.deepspeed_env") and not os.path.exists(os.path.dirname(env_path))


def _git_status() -> str:
    """The checkout's changed and untracked files (empty in a clean clone)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_killed_rank_ends_job_within_60s_naming_it(cluster, hostfile, tmp_path):
    out, port = str(tmp_path / "out"), free_port()
    options = ["--hostfile", hostfile, "--master-port", str(port)]
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, tiny_args(out, 10_000))
    deadline = time.monotonic() + 240
    while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and losses(out)):  # mid-run: a step is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.5)
    os.kill(rank_pid(port, 1, deadline), signal.SIGKILL)
    killed = time.monotonic()
    output = proc.communicate(timeout=90)[0]
    assert time.monotonic() - killed < 60
    assert proc.returncode != 0
    assert "job failed: rank 1 on 127.0.0.2 was killed by signal 9 (SIGKILL)" in output, output[-4000:]
    assert not [p for p in psutil.process_iter() if has_port(p, port)], "ranks left behind"


def test_watchdog_stops_a_hung_survivor(cluster, hostfile, tmp_path):
    """Rank 1 fails while rank 0 hangs (as in a stuck NCCL call): the launcher stops rank 0 itself after the grace."""
    port = free_port()
    options = ["--hostfile", hostfile, "--master-port", str(port), "--failure-grace", "2", "--script", PROBE]
    args = ["steps=1000", "pause=0.05", "fail_rank=1", "fail_step=5", "survivor=hang", f"train.output_dir={tmp_path}/o"]
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, args)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    assert "ranks still running; stopping the job on every host" in output, output[-4000:]
    assert "job failed: rank 1 on 127.0.0.2 exited with code 3" in output
    assert not [p for p in psutil.process_iter() if has_port(p, port)], "ranks left behind"


# ---------------------------------------------------------------- the cluster doctor (finetune/multinode/doctor.py)


def test_doctor_prints_bandwidth_and_latency_per_node(cluster, hostfile, tmp_path):
    options = ["--hostfile", hostfile, "--doctor"]
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, [f"train.output_dir={tmp_path}/out"])
    output = proc.communicate(timeout=180)[0]
    assert proc.returncode == 0, output[-4000:]
    assert "--module finetune.multinode.doctor_worker --rank-hosts 127.0.0.1,127.0.0.2" in output
    gbps = r"\d+\.\d\d"
    for host, rank, to in (("127.0.0.1", 0, "127.0.0.2"), ("127.0.0.2", 1, "127.0.0.1")):
        # node, ranks, all-reduce and all-to-all bus bandwidth, latency (us), link to the next node, copy, join
        row = rf"^{host} +{rank} +{gbps} +{gbps} +\d+ +{gbps} to {to} +{gbps} +{gbps} +gloo tcp \(lo\)$"
        assert re.search(row, output, re.M), output[-4000:]
    slowest = rf"^slowest node: 127\.0\.0\.[12] \(all-reduce {gbps} GB/s, latency \d+ us\)"
    assert re.search(slowest + r"(; highest latency: 127\.0\.0\.[12] \(\d+ us\))?$", output, re.M), output[-4000:]
    assert re.search(rf"^slowest link: 127\.0\.0\.(1 -> 127\.0\.0\.2|2 -> 127\.0\.0\.1) \({gbps} GB/s\)$", output, re.M)
    assert output.endswith("doctor: ok\n") and "job finished" not in output and "main.py" not in output


def test_doctor_names_a_node_whose_sshd_is_down_within_30s(cluster, tmp_path):
    """127.0.0.3's ssh goes to a port where no sshd listens (stopped); 127.0.0.1 is served by the fixture's."""
    aliases = {"127.0.0.1": ("127.0.0.1", cluster.port), "127.0.0.3": ("127.0.0.3", free_port("127.0.0.3"))}
    bin_dir = write_ssh_wrapper(str(tmp_path), aliases, key=os.path.join(cluster.root, "user_key"))
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")
    env = cluster.env()
    env["PATH"] = bin_dir + os.pathsep + env["PATH"]
    start = time.monotonic()
    options = ["--hostfile", str(tmp_path / "hosts"), "--doctor"]
    proc = launch(cluster.prefix, tmp_path / "cwd", env, options, [f"train.output_dir={tmp_path}/out"])
    output = proc.communicate(timeout=60)[0]
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, output[-4000:]
    assert re.search(r"^FAIL 127\.0\.0\.3 reach: ssh failed: .*Connection refused", output, re.M), output[-4000:]
    assert not re.search(r"^FAIL 127\.0\.0\.1", output, re.M) and "nothing was started" in output
