"""The hostfile launcher (finetune/multinode/launcher.py, hostfile.py, preflight.py).

Unit, seconds: hostfile errors, filters, Slurm node lists, golden dry runs for 1, 2 and 4 hosts (pdsh, OpenMPI,
Slurm), .deepspeed_env merging, failure parsing, and a preflight that names unreachable hosts within 10 s.
Real runs, about 2 minutes: a private sshd makes 127.0.0.1 and 127.0.0.2 two "nodes"; the tiny recipe on 2 nodes x 1
slot through pdsh and through OpenMPI gives the losses of a single-node 2-process run; a rank killed mid-run ends
the job within 60 s naming it; a survivor that hangs is stopped by the launcher's watchdog. Loopback only.

    ZEROTUNE_UPDATE_GOLDEN=1 pytest tests/test_launcher.py -k golden    # rewrite tests/golden/launch/*.txt
"""

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

from finetune.multinode import launcher
from finetune.multinode.hostfile import HostfileError, expand_nodelist, filter_hosts, load_hostfile, parse_hostfile, slurm_hosts
from finetune.multinode.jobwatch import JobWatch
from finetune.multinode.launcher import LaunchError, merge_env_file
from tests.sshd_fixture import IsolatedNetwork, LoopbackCluster, free_port, missing_binaries, write_ssh_wrapper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "launch")
PROBE = os.path.join(ROOT, "tests", "launch_probe.py")
UPDATE_GOLDEN = bool(os.environ.get("ZEROTUNE_UPDATE_GOLDEN"))
TRAIN_ARGS = ["--deepspeed", "ds_configs/zero3.json", "--config", "recipes/tiny.yaml", "train.max_steps=10"]


# ---------------------------------------------------------------- hostfiles, filters, Slurm


@pytest.mark.parametrize(
    "text, message",
    [
        ("node1 slots=2\nnode2 slot=2\n", r"hf:2: expected `HOST slots=N`.*'node2 slot=2'"),
        ("# comment\n\nnode1 slots=2\nnode1 slots=4\n", r"hf:4: node1 is listed twice \(first on line 3\)"),
        ("node1 slots=0\n", r"hf:1: node1 has slots=0"),
        ("node1 slots=-2\n", r"hf:1: node1 has slots=-2"),
        ("node1\n", r"hf:1: expected `HOST slots=N`"),
        ("# only comments\n\n", r"hf: no hosts"),
    ],
)
def test_hostfile_errors_name_file_and_line(text, message):
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(text, "hf")


def test_hostfile_grammar_and_missing_file(tmp_path):
    assert parse_hostfile("# two nodes\n\n  a slots=8\nb slots=4   # comment\n") == {"a": 8, "b": 4}
    with pytest.raises(HostfileError, match="not found"):
        load_hostfile(str(tmp_path / "nope"))


def test_missing_hostfile_is_refused_not_run_locally(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launcher.main(["--hostfile", "nope", "--", *TRAIN_ARGS]) == 2
    assert "hostfile 'nope' not found" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / ".deepspeed_env")


def test_include_exclude_in_deepspeed_syntax():
    pool = {"a": 2, "b": 4, "c": 1}
    assert filter_hosts(pool, include="a:1@c") == {"a": [1], "c": [0]}
    assert filter_hosts(pool, include="c@a") == {"a": [0, 1], "c": [0]}  # hostfile order = rank order
    assert filter_hosts(pool, exclude="b") == {"a": [0, 1], "c": [0]}
    assert filter_hosts(pool, exclude="b:0,3") == {"a": [0, 1], "b": [1, 2], "c": [0]}
    for kwargs, message in [
        ({"include": "d"}, "'d' is not in the hostfile"),
        ({"include": "a:2"}, "a has slots 0..1"),
        ({"include": "a", "exclude": "b"}, "mutually exclusive"),
        ({"exclude": "a@b@c"}, "leaves no hosts"),
    ]:
        with pytest.raises(HostfileError, match=message):
            filter_hosts(pool, **kwargs)


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu-st-p4d-24xlarge-[1,10]", ["gpu-st-p4d-24xlarge-1", "gpu-st-p4d-24xlarge-10"]),
        ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
        ("single", ["single"]),
    ],
)
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_slurm_slots_per_node():
    nodes = {"SLURM_JOB_NODELIST": "n[1-2]"}
    assert slurm_hosts({**nodes, "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1"}) == {"n1": 8, "n2": 8}
    assert slurm_hosts({**nodes, "SLURM_GPUS_PER_NODE": "h100:4"}) == {"n1": 4, "n2": 4}
    assert slurm_hosts({**nodes, "SLURM_NTASKS_PER_NODE": "2"}) == {"n1": 2, "n2": 2}
    with pytest.raises(HostfileError, match="--gpus-per-node"):
        slurm_hosts(nodes)
    with pytest.raises(HostfileError, match="sbatch"):
        slurm_hosts({})
    with pytest.raises(HostfileError, match="bad range"):
        expand_nodelist("n[a-b]")


# ---------------------------------------------------------------- dry runs against golden files


GOLDEN_CASES = {
    "one_host": (["--hostfile", f"{ROOT}/hostfiles/localhost"], {}),
    "two_hosts": (["--hostfile", f"{GOLDEN}/two_hosts.hostfile"], {}),
    "four_hosts": (["--hostfile", f"{GOLDEN}/four_hosts.hostfile", "--exclude", "127.0.0.4:1"], {}),
    "two_hosts_openmpi": (["--hostfile", f"{GOLDEN}/two_hosts.hostfile", "--launcher", "openmpi"], {}),
    "four_hosts_slurm": (
        ["--launcher", "slurm"],
        {"SLURM_JOB_NODELIST": "gpu[01-03,07]", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_ID": "4242",
         "SLURM_CPUS_ON_NODE": "96"},
    ),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_dry_run_matches_golden(case, tmp_path, monkeypatch, capsys):
    options, extra_env = GOLDEN_CASES[case]
    for key in list(os.environ):
        monkeypatch.delenv(key)
    environ = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "NCCL_DEBUG": "WARN", "HF_TOKEN": "secret", **extra_env}
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "_is_root", lambda: True)  # mpirun needs --allow-run-as-root as root only
    monkeypatch.setattr(sys, "executable", "/opt/venv/bin/python")  # the same PATH and `deepspeed` on any machine
    assert launcher.main([*options, "--master-port", "29611", "--dry-run", "--", *TRAIN_ARGS]) == 0
    out = capsys.readouterr().out.replace(str(tmp_path), "<CWD>").replace(ROOT, "<REPO>")
    path = os.path.join(GOLDEN, f"{case}.txt")
    if UPDATE_GOLDEN or not os.path.exists(path):
        with open(path, "w") as f:
            f.write(out)
    with open(path) as f:
        assert out == f.read(), f"dry run differs from {path}; ZEROTUNE_UPDATE_GOLDEN=1 rewrites it"
    assert os.listdir(tmp_path) == [], "a dry run writes nothing"
    assert "secret" not in out


def test_env_file_keeps_user_lines_and_replaces_ours():
    existing = "NCCL_IB_HCA=mlx5\n\nPATH=/old/bin\nMY_FLAG=a=b\n"
    merged = merge_env_file(existing, {"PATH": "/venv/bin:/usr/bin", "GLOO_SOCKET_IFNAME": "lo"})
    assert merged == "NCCL_IB_HCA=mlx5\nPATH=/venv/bin:/usr/bin\nMY_FLAG=a=b\nGLOO_SOCKET_IFNAME=lo\n"
    with pytest.raises(LaunchError, match=r"\.deepspeed_env:2: 'export X' is not KEY=VALUE"):
        merge_env_file("A=1\nexport X\n", {})
    environ = {"NCCL_DEBUG": "INFO", "HF_TOKEN": "t", "WANDB_API_KEY": "k", "HOME": "/h", "PATH": "/bin"}
    exports = launcher.build_exports(environ)
    assert set(exports) == {"NCCL_DEBUG", "PATH", "PYTHONPATH"} and exports["PYTHONPATH"] == ROOT


def test_master_address_comes_from_the_ssh_alias(tmp_path, monkeypatch, capsys):
    if missing_binaries(("ssh",)):
        pytest.skip("needs the ssh client")
    bin_dir = write_ssh_wrapper(str(tmp_path), {"nodeA": ("127.0.0.2", 2222), "nodeB": ("127.0.0.3", 2222)})
    monkeypatch.setenv("PATH", bin_dir + os.pathsep + os.environ["PATH"])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("nodeA slots=2\nnodeB slots=2\n")
    assert launcher.main(["--hostfile", "hosts", "--master-port", "29611", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--master_addr 127.0.0.2 --master_port 29611" in out and "GLOO_SOCKET_IFNAME=lo" in out


# ---------------------------------------------------------------- failure reports


def test_job_watch_names_the_lost_rank():
    watch = JobWatch({"node1": [0, 1], "node2": [2, 3]})
    watch.feed("node1: RuntimeError: [gloo] Connection closed by peer [127.0.0.2]:1234\n")
    failure = watch.feed("pdsh@login: node1: ssh exited with exit code 1\n")
    assert str(failure) == "a rank of 0-1 on node1 exited with code 1"
    assert watch.feed("pdsh@login: node1: ssh exited with exit code 1\n") is None  # reported once
    watch.feed("pdsh@login: node2: ssh exited with exit code 247\n")
    assert watch.summary() == (  # node1 only lost its peer: node2 is named first
        "a rank of 2-3 on node2 was killed by signal 9 (SIGKILL) (after it: a rank of 0-1 on node1 exited with code 1)"
    )
    mpi = JobWatch({"node1": [0], "node2": [1]})
    line = "mpirun noticed that process rank 1 with PID 77 on node node2 exited on signal 9 (Killed).\n"
    assert str(mpi.feed(line)) == "rank 1 on node2 was killed by signal 9 (SIGKILL)"
    mpi = JobWatch({"node1": [0], "node2": [1]})
    assert mpi.feed("  Process name: [[31424,1],1]\n") is None
    assert str(mpi.feed("  Exit code:    3\n")) == "rank 1 on node2 exited with code 3"
    srun = JobWatch({"gpu01": list(range(8)), "gpu02": list(range(8, 16))})
    assert str(srun.feed("srun: error: gpu02: task 1: Killed\n")) == "a rank of 8-15 on gpu02 killed"
    lost = JobWatch({"node1": [0], "node2": [1]})
    assert "was lost: ssh exited with 255" in str(lost.feed("pdsh@x: node2: ssh exited with exit code 255\n"))


# ---------------------------------------------------------------- preflight


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


def test_preflight_refuses_a_busy_master_port(tmp_path, monkeypatch, capsys):
    """One local host: no ssh, the probe runs here; the port check fails and nothing is written or started."""
    monkeypatch.chdir(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        options = ["--hostfile", f"{ROOT}/hostfiles/localhost", "--master-port", str(port)]
        code = launcher.main([*options, "--", f"train.output_dir={tmp_path}/o"])
    out = capsys.readouterr()
    assert code == 1
    assert re.search(r"localhost +ok .* +ok +\d+ in use", out.out), out.out
    assert f"FAIL localhost port: {port} in use on the master host" in out.out
    assert os.listdir(tmp_path) == ["o"] and os.listdir(tmp_path / "o") == [], "no .deepspeed_env, no preflight marker"


def test_preflight_flags_hosts_that_differ(monkeypatch):
    from finetune.multinode import preflight

    cells = {"python": "3.11.7", "torch": "2.13.0", "deepspeed": "0.19.8", "zerotune": "0.1.0", "commit": "abc",
             "source": "1234", "accelerators": "8 (slots 8)"}
    rows = [preflight.HostRow("a", dict(cells)), preflight.HostRow("b", dict(cells, torch="2.12.0")),
            preflight.HostRow("c", dict(cells, accelerators="0 (cpu)"))]
    preflight._compare(rows)
    assert rows[1].problems == ["torch: 2.12.0 here, 2.13.0 on a; every node must run the same environment and code"]
    assert rows[2].problems == ["accelerators: 0 (cpu) here, 8 (slots 8) on a"]
    assert "2.12.0 *" in preflight.PreflightReport(rows, [], 0.1).table()


def test_openmpi_filters_whole_hosts_through_a_hostfile(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hosts = f"{GOLDEN}/four_hosts.hostfile"
    args = ["--hostfile", hosts, "--launcher", "openmpi", "--master-port", "29611", "--dry-run"]
    assert launcher.main([*args, "--exclude", "127.0.0.2@127.0.0.3"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"runs/hostfile-\w{8}:\n127.0.0.1 slots=2\n127.0.0.4 slots=2\n", out), out
    assert re.search(r"--hostfile runs/hostfile-\w{8} ", out) and "WORLD_SIZE=4" in out
    assert launcher.main([*args, "--include", "127.0.0.1:0"]) == 2
    assert "openmpi places ranks on whole hosts" in capsys.readouterr().err


# ---------------------------------------------------------------- real runs on two loopback "nodes"


@pytest.fixture(scope="module")
def netns():
    """A command prefix that runs inside a loopback-only network namespace (empty where not permitted)."""
    with IsolatedNetwork() as net:
        yield net.prefix


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, netns):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"two-node runs need {', '.join(missing)} (apt-get install openssh-server pdsh openmpi-bin)")
    with LoopbackCluster(str(tmp_path_factory.mktemp("sshd")), prefix=netns) as c:
        yield c


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hosts") / "two_nodes"
    path.write_text("# two loopback nodes served by tests/sshd_fixture.py\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    return str(path)


def tiny_args(out: str, steps: int) -> list[str]:
    """The tiny recipe with repo-absolute paths: the launch runs from a temporary folder, not the repo."""
    return [
        "--deepspeed", f"{ROOT}/ds_configs/zero3.json", "--config", f"{ROOT}/recipes/tiny.yaml",
        f"model.path={ROOT}/recipes/tiny_model", f"data.path={ROOT}/recipes/data/tiny_instruct.jsonl",
        f"train.max_steps={steps}", "train.log_every=1", "train.sample_prompt=null", f"train.output_dir={out}",
    ]


def launch(prefix: list[str], cwd, env, options: list[str], train_args: list[str]) -> subprocess.Popen:
    """`python -m finetune.multinode.launcher` from `cwd` (not the repo: .deepspeed_env lands there), inside `prefix`'s netns."""
    os.makedirs(cwd, exist_ok=True)
    env = dict(env, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))  # the shm op, built once
    cmd = [*prefix, sys.executable, "-m", "finetune.multinode.launcher", *options, "--", *train_args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


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
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, tiny_args(out, 10))
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    assert re.search(r"127.0.0.1 +ok .*ok, shared +free", output), output
    assert re.search(r"127.0.0.2 +ok .*ok, shared +-", output), output
    assert "--master_addr 127.0.0.1" in output and "zerotune launch: job finished" in output
    two_nodes = losses(out)
    assert len(two_nodes) == len(single_node_losses) == 10
    assert two_nodes == pytest.approx(single_node_losses, rel=1e-5)
    with open(tmp_path / "cwd" / ".deepspeed_env") as f:
        env_file = f.read()
    for line in ("GLOO_SOCKET_IFNAME=lo", f"PYTHONPATH={ROOT}", "TORCH_EXTENSIONS_DIR="):
        assert line in env_file


def _rank_pid(port: int, rank: int, deadline: float) -> int:
    """The pid of `rank` of the job whose MASTER_PORT is `port` (only our own job's processes match)."""
    while time.monotonic() < deadline:
        for p in psutil.process_iter(["cmdline"]):
            try:
                env, cmdline = p.environ(), p.info["cmdline"] or []
                if "-u" in cmdline and env.get("MASTER_PORT") == str(port) and env.get("RANK") == str(rank):
                    return p.pid
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.5)
    raise AssertionError(f"rank {rank} of the job on port {port} never started")


def test_killed_rank_ends_job_within_60s_naming_it(cluster, hostfile, tmp_path):
    out, port = str(tmp_path / "out"), free_port()
    options = ["--hostfile", hostfile, "--master-port", str(port)]
    proc = launch(cluster.prefix, tmp_path / "cwd", cluster.env(), options, tiny_args(out, 10_000))
    deadline = time.monotonic() + 240
    while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and losses(out)):  # mid-run: a step is done
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.5)
    os.kill(_rank_pid(port, 1, deadline), signal.SIGKILL)
    killed = time.monotonic()
    output = proc.communicate(timeout=90)[0]
    assert time.monotonic() - killed < 60
    assert proc.returncode != 0
    assert "job failed: rank 1 on 127.0.0.2 was killed by signal 9 (SIGKILL)" in output, output[-4000:]
    assert not [p for p in psutil.process_iter() if _has_port(p, port)], "ranks left behind"


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
    assert not [p for p in psutil.process_iter() if _has_port(p, port)], "ranks left behind"


def _has_port(p: psutil.Process, port: int) -> bool:
    try:
        return p.environ().get("MASTER_PORT") == str(port) and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
