"""The hostfile launcher (finetune/multinode/launcher.py, hostfile.py, preflight.py).

Unit, seconds: hostfile errors, filters, Slurm node lists, golden dry runs for 1, 2 and 4 hosts (pdsh, OpenMPI,
Slurm), .deepspeed_env merging, failure parsing, and a preflight that names unreachable hosts within 10 s.
Real runs, about 2 minutes: a private sshd makes 127.0.0.1 and 127.0.0.2 two "nodes"; the tiny recipe on 2 nodes x 1
slot through pdsh and through OpenMPI gives the losses of a single-node 2-process run; a rank killed mid-run ends
the job within 60 s naming it; a survivor that hangs is stopped by the launcher's watchdog. Loopback only.

    ZEROTUNE_UPDATE_GOLDEN=1 pytest tests/unit/test_launcher.py -k golden    # rewrite tests/fixtures/golden/launch/*.txt
"""

from __future__ import annotations

import os
import re
import socket
import sys

import pytest

from finetune.multinode import launcher
from finetune.multinode.hostfile import HostfileError, expand_nodelist, filter_hosts, load_hostfile, parse_hostfile, slurm_hosts
from finetune.multinode.jobwatch import JobWatch
from finetune.multinode.launcher import LaunchError, merge_env_file
from tests.fixtures.launch_args import GOLDEN, TRAIN_ARGS
from tests.fixtures.sshd_fixture import missing_binaries, write_ssh_wrapper
from tests.helpers import ROOT

UPDATE_GOLDEN = bool(os.environ.get("ZEROTUNE_UPDATE_GOLDEN"))


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
























# ---------------------------------------------------------------- one machine, two names; bracketed IPv6


def test_one_machine_under_two_names_is_refused(tmp_path, capsys, monkeypatch):
    """`localhost`, 127.0.0.1 and ::1 are this machine however they are written: DeepSpeed would start both lines'
    ranks on it, on the same local GPUs. The message names both lines. Other loopback addresses (the two-"node"
    sshd of the real runs) and names that resolve nowhere (the preflight reports those) still load."""
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n# the same machine again:\n127.0.0.1 slots=2\n")
    with pytest.raises(HostfileError, match=re.escape(
            f"{hostfile}:3: 127.0.0.1 and {hostfile}:1: localhost are one machine (both reach this machine): "
            f"DeepSpeed would start both lines' ranks there, on the same GPUs. Keep one line for it, with all its slots")):
        load_hostfile(str(hostfile))
    hostfile.write_text("127.0.0.2 slots=1\nlocalhost slots=1\n[::1] slots=1\n")
    with pytest.raises(HostfileError, match=re.escape(f"{hostfile}:3: ::1 and {hostfile}:2: localhost are one machine")):
        load_hostfile(str(hostfile))
    assert launcher.main(["--hostfile", str(hostfile), "--dry-run"]) == 2
    assert "zerotune: error: " in capsys.readouterr().err
    hostfile.write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\nno-such-node.invalid slots=1\n")
    assert load_hostfile(str(hostfile)) == {"127.0.0.1": 1, "127.0.0.2": 1, "no-such-node.invalid": 1}


def test_bracketed_ipv6_is_read_bare_and_local(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("[::1] slots=2\n")
    assert load_hostfile(str(hostfile)) == {"::1": 2}
    assert launcher.main(["--hostfile", str(hostfile), "--master-port", "29611", "--dry-run", "--", *TRAIN_ARGS]) == 0
    out = capsys.readouterr().out
    # This machine: started here (no ssh, no --force_multi), from a hostfile naming it as pdsh and ssh take it.
    assert re.search(r"\nruns/hostfile-\w{8}:\n::1 slots=2\n", out), out
    assert re.search(r"--hostfile runs/hostfile-\w{8} --master_addr ::1 --master_port 29611 --no_ssh_check ", out), out
    assert "--force_multi" not in out
    from finetune.multinode import preflight  # the master-port check binds an IPv6 address too

    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        port = probe.getsockname()[1]
    report = preflight.run_preflight({"::1": 2}, preflight.Transport("local"), output_dir=str(tmp_path / "o"),
                                     master_addr="::1", master_port=port)
    assert report.rows[0].cells["port"] == "free", report.table()
    for text, message in [("[::1] slots=1\n::1 slots=1\n", r"hf:2: ::1 is listed twice \(first on line 1\)"),
                          ("[node1] slots=1\n", r"hf:1: '\[node1\]': brackets hold an IPv6 address")]:
        with pytest.raises(HostfileError, match=message):
            parse_hostfile(text, "hf")
