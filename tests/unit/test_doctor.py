"""The cluster doctor's reading and reporting (finetune/multinode/doctor.py), in process: NCCL's INFO lines (IB with
GPUDirect RDMA, a TCP socket fallback, a wrong NCCL_SOCKET_IFNAME, one GPU alone), interface names as NCCL and gloo
read them, bus bandwidth as nccl-tests defines it, the per-node table with the slowest node and link, ranks that
never answered, and the command a launch runs. Its integration half (real ranks on two loopback "nodes", a node
whose sshd is down, the quick run blocking training) is at the end of tests/integration/test_launcher.py.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from finetune.multinode import doctor, launcher
from finetune.multinode.doctor import DoctorReport, bus_bandwidth, ifname_problems, nccl_findings, parse_nccl_log
from finetune.multinode.jobwatch import JobWatch
from tests.fixtures.launch_args import GOLDEN, TRAIN_ARGS

IB_TWO_NODES = """\
gpu01:4021:4021 [0] NCCL INFO Bootstrap : Using ib0:10.10.0.1<0>
gpu01:4021:4021 [0] NCCL INFO cudaDriverVersion 12040
gpu01:4021:4021 [0] NCCL INFO NCCL version 2.21.5+cuda12.4
gpu01:4021:4102 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
gpu01:4021:4102 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB ib0:10.10.0.1<0>
gpu01:4021:4102 [0] NCCL INFO Using non-device net plugin version 0
gpu01:4021:4102 [0] NCCL INFO Using network IB
gpu01:4021:4102 [0] NCCL INFO comm 0x5581e2c0 rank 0 nRanks 4 nNodes 2 localRanks 2 localRank 0 MNNVL 0
gpu01:4021:4102 [0] NCCL INFO NVLS multicast support is available on dev 0
gpu01:4021:4102 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
gpu01:4021:4102 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu01:4021:4102 [0] NCCL INFO Channel 01/0 : 0[0] -> 2[0] [send] via NET/IB/1(0)/GDRDMA
gpu01:4021:4102 [0] NCCL INFO 24 coll channels, 24 collnet channels, 16 nvls channels, 32 p2p channels
"""

SOCKET_TWO_NODES = """\
node1:311:311 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
node1:311:311 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.5<0>
node1:311:311 [0] NCCL INFO NET/IB : No device found.
node1:311:311 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.5<0>
node1:311:311 [0] NCCL INFO Using network Socket
node1:311:340 [0] NCCL INFO comm 0x55d6a0 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
node1:311:340 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Socket/0
node1:311:340 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""

WRONG_IFNAME = """\
node1:311:311 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth9
node1:311:311 [0] bootstrap.cc:45 NCCL WARN Bootstrap : no socket interface found
node1:311:311 [0] NCCL INFO init.cc:82 -> 3
"""

ONE_GPU = """\
h200:77:77 [0] NCCL INFO Bootstrap: Using eth0:10.1.2.3<0>
h200:77:77 [0] NCCL INFO NCCL version 2.27.5+cuda12.9
h200:77:90 [0] NCCL INFO NET/IB : No device found.
h200:77:90 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0> [1]docker0:172.17.0.1<0>
h200:77:90 [0] NCCL INFO Using network Socket
h200:77:90 [0] NCCL INFO comm 0x5b10 rank 0 nRanks 1 nNodes 1 localRanks 1 localRank 0 MNNVL 0
"""


def test_nccl_over_infiniband_with_gpudirect_is_read_and_passes():
    info = parse_nccl_log(IB_TWO_NODES)
    assert info["version"] == "2.21.5+cuda12.4" and info["network"] == "IB" and info["nodes"] == 2
    assert info["ib_devices"] == ["mlx5_0/IB", "mlx5_1/IB"] and info["nvls"]
    assert info["paths"] == ["P2P/IPC", "NET/IB/GDRDMA"]
    assert doctor.describe_transport(info) == "NCCL 2.21.5+cuda12.4 IB: P2P/IPC, NET/IB/GDRDMA, NVLS"
    assert nccl_findings(info, nodes=2, environ={}, rdma_devices=["mlx5_0", "mlx5_1"]) == ([], [])


def test_socket_fallback_between_nodes_is_flagged():
    info = parse_nccl_log(SOCKET_TWO_NODES)
    assert info["network"] == "Socket" and info["ib_missing"] and info["socket_ifaces"] == ["eth0"]
    assert info["paths"] == ["NET/Socket"]
    problems, warnings = nccl_findings(info, nodes=2, environ={}, rdma_devices=["mlx5_0"])
    assert problems == ["NCCL fell back to TCP sockets between nodes although this node has mlx5_0; check "
                        "NCCL_IB_HCA, the rdma-core/libibverbs install and the NCCL net plugin"] and warnings == []
    problems, warnings = nccl_findings(info, nodes=2, environ={}, rdma_devices=[])
    assert problems == [] and "TCP sockets between nodes (no InfiniBand/RoCE device here)" in warnings[0]
    problems, warnings = nccl_findings(info, nodes=2, environ={"NCCL_IB_DISABLE": "1"}, rdma_devices=["mlx5_0"])
    assert problems == [] and "because NCCL_IB_DISABLE is set" in warnings[0]
    assert nccl_findings(info, nodes=1, environ={}, rdma_devices=["mlx5_0"]) == ([], []), "one node: no network"


def test_no_socket_interface_names_the_variable():
    problems, warnings = nccl_findings(parse_nccl_log(WRONG_IFNAME), nodes=2, environ={"NCCL_SOCKET_IFNAME": "eth9"},
                                       rdma_devices=[])
    assert problems == ["NCCL found no usable network interface (NCCL_SOCKET_IFNAME=eth9); set NCCL_SOCKET_IFNAME "
                        "to the interface that reaches the other nodes"]
    assert warnings == []


def test_one_gpu_reports_its_transport_and_nothing_to_fix():
    info = parse_nccl_log(ONE_GPU)
    assert info["nodes"] == 1 and info["socket_ifaces"] == ["eth0", "docker0"] and info["paths"] == []
    assert doctor.describe_transport(info) == "NCCL 2.27.5+cuda12.9 Socket (eth0,docker0)"
    assert nccl_findings(info, nodes=1, environ={}, rdma_devices=[]) == ([], [])
    assert doctor.describe_transport(parse_nccl_log("")) == "NCCL (no INFO lines in its log)"


@pytest.mark.parametrize("key, value, interfaces, ok", [
    ("NCCL_SOCKET_IFNAME", "eth", ["lo", "eth0"], True),  # NCCL: a prefix
    ("NCCL_SOCKET_IFNAME", "=eth", ["lo", "eth0"], False),  # `=`: exact names
    ("NCCL_SOCKET_IFNAME", "=eth0,ib0", ["lo", "eth0"], True),
    ("NCCL_SOCKET_IFNAME", "^lo,docker", ["lo", "eth0"], True),  # `^`: avoid these; eth0 is left
    ("NCCL_SOCKET_IFNAME", "^lo", ["lo"], False),
    ("NCCL_SOCKET_IFNAME", "ens9f0", ["lo", "eth0"], False),
    ("GLOO_SOCKET_IFNAME", "lo", ["lo", "eth0"], True),
    ("GLOO_SOCKET_IFNAME", "eth", ["lo", "eth0"], False),  # gloo: exact names only
    ("GLOO_SOCKET_IFNAME", "lo,eth1", ["lo", "eth0"], False),
])
def test_interface_names_as_nccl_and_gloo_read_them(key, value, interfaces, ok):
    backend = "nccl" if key.startswith("NCCL") else "gloo"
    problems, warnings = ifname_problems({key: value}, interfaces, backend=backend)
    assert (problems == []) == ok and warnings == []
    if not ok:
        assert problems == [f"{key}={value} names no interface of this node (it has {', '.join(interfaces)}); set it "
                            "to the one that reaches the other nodes, or unset it"]


def test_a_wrong_name_for_the_other_backend_is_a_warning():
    problems, warnings = ifname_problems({"GLOO_SOCKET_IFNAME": "eth7"}, ["lo", "eth0"], backend="nccl")
    assert problems == [] and warnings[0].startswith("GLOO_SOCKET_IFNAME=eth7 names no interface")


def test_bus_bandwidth_as_nccl_tests_define_it():
    # 1 GB in 0.1 s: algbw 10 GB/s; all-reduce x 2(n-1)/n, all-to-all x (n-1)/n
    assert bus_bandwidth("all-reduce", 1e9, 0.1, 8) == pytest.approx(17.5)
    assert bus_bandwidth("all-to-all", 1e9, 0.1, 8) == pytest.approx(8.75)
    assert bus_bandwidth("all-reduce", 1e9, 0.1, 2) == pytest.approx(10.0)
    assert bus_bandwidth("all-reduce", 1e9, 0.1, 1) is None, "one rank: nothing crosses a link"


def _result(allreduce_s: float, latency_s: float, link: dict | None = None, **extra) -> dict:
    return {"backend": "gloo", "device": "cpu", "problems": [], "warnings": [], "bytes": 8 << 20, "iters": 5,
            "small_bytes": 8, "init_s": 0.5, "latency_s": latency_s, "allreduce_s": allreduce_s, "alltoall_s": 0.02,
            "copy_s": 0.004, "link": link, "transport": "gloo tcp (lo)", **extra}


def _line(rank: int, host: str | None = None, **record) -> str:
    text = doctor.TAG + json.dumps({"rank": rank, **record})
    return f"{host}: {text}\n" if host else text + "\n"  # pdsh prefixes remote lines with the host


def test_table_names_the_slowest_node_and_link():
    report = DoctorReport({"n1": [0, 1], "n2": [2, 3]}, seconds=4.2)
    mib8 = 8 << 20
    results = {0: _result(0.010, 50e-6, {"to": "n2", "bytes": mib8, "seconds": 0.004}), 1: _result(0.011, 60e-6),
               2: _result(0.020, 90e-6, {"to": "n1", "bytes": mib8, "seconds": 0.008}), 3: _result(0.012, 40e-6)}
    for rank, result in results.items():
        report.feed(_line(rank, "n1" if rank < 2 else "n2", stage="started"))
        report.feed(_line(rank, "n1" if rank < 2 else "n2", result=result))
    table = report.table()
    assert report.ok and table.endswith("doctor: ok"), table
    # all-reduce busbw of n2: its slower rank, 8 MiB in 0.020 s x 2(4-1)/4; latency: its slowest rank's
    slow = bus_bandwidth("all-reduce", mib8, 0.020, 4)
    assert f"\nslowest node: n2 (all-reduce {slow:.2f} GB/s, latency 90 us)\n" in table
    assert f"slowest link: n2 -> n1 ({mib8 / 0.008 / 1e9:.2f} GB/s)" in table
    row = next(line for line in table.splitlines() if line.startswith("n1 "))
    assert row.split()[:5] == ["n1", "0-1", f"{bus_bandwidth('all-reduce', mib8, 0.011, 4):.2f}",
                               f"{bus_bandwidth('all-to-all', mib8, 0.02, 4):.2f}", "60"]


def test_the_node_with_the_highest_latency_is_named_when_it_is_another():
    report = DoctorReport({"n1": [0], "n2": [1]})
    report.feed(_line(0, "n1", result=_result(0.010, 300e-6)))
    report.feed(_line(1, "n2", result=_result(0.020, 40e-6)))
    assert "latency 40 us); highest latency: n1 (300 us)\n" in report.table()


def test_silent_and_lost_ranks_are_named():
    report = DoctorReport({"n1": [0], "n2": [1], "n3": [2]})
    report.feed(_line(0, "n1", stage="started"))
    report.feed(_line(1, "n2", stage="started"))
    assert report.problems() == ["n1 rank 0: no answer: never joined the others",
                                 "n2 rank 1: no answer: never joined the others",
                                 "n3 rank 2: no answer: never started (ssh, the python path or the runner failed there)"]
    report.lost.append(JobWatch(report.ranks).feed("pdsh@head: n3: ssh exited with exit code 255\n"))
    assert report.problems() == ["rank 2 on n3 was lost: ssh exited with 255 (host down, network, or sshd)",
                                 "n1 rank 0: no answer: never joined the others",
                                 "n2 rank 1: no answer: never joined the others"]
    assert not report.ok and report.table().endswith("doctor: 3 problem(s)")


def test_a_job_stopped_after_a_failure_names_whom_a_rank_waited_for():
    report = DoctorReport({"n1": [0], "n2": [1], "n3": [2]}, cut_short=True)
    report.feed(_line(0, "n1", stage="started"))
    report.feed(_line(1, "n2", result={"problems": ["NCCL_SOCKET_IFNAME=eth9 names no interface"], "warnings": []}))
    assert report.problems() == ["n2 rank 1: NCCL_SOCKET_IFNAME=eth9 names no interface"], "the others only waited"
    report.feed(_line(0, "n1", error="still in stage 'join' after 60 s: a peer never answered", waited=True))
    assert report.problems()[1:] == [
        "n1 rank 0: still in stage 'join' after 60 s: a peer never answered",
        "n3 rank 2: no answer: never started (ssh, the python path or the runner failed there)"]


def test_a_failed_check_is_reported_once_per_rank():
    report = DoctorReport({"n1": [0], "n2": [1]})
    bad = {"backend": "gloo", "device": "cpu", "problems": ["GLOO_SOCKET_IFNAME=eth9 names no interface"],
           "warnings": []}
    report.feed(_line(1, "n2", result=bad))
    report.feed(_line(0, "n1", error="join: RuntimeError: timed out"))
    assert report.failed()
    assert report.problems() == ["n2 rank 1: GLOO_SOCKET_IFNAME=eth9 names no interface",
                                 "n1 rank 0: join: RuntimeError: timed out"]
    table = report.table()
    assert re.search(r"^n2 +1 +- +- +- +- +- +- +-$", table, re.M), table  # no timings, no transport
    assert "\nFAIL n2 rank 1: GLOO_SOCKET_IFNAME=eth9 names no interface\n" in table


def test_one_rank_says_there_is_nothing_to_compare():
    report = DoctorReport({"h200": [0]}, {0: {"result": _result(0.001, 20e-6, device="NVIDIA H200")}})
    table = report.table()
    assert "one rank: nothing to compare across ranks or nodes" in table and report.ok
    row = table.splitlines()[3].split()
    assert row[:5] == ["h200", "0", "-", "-", "20"], "no bus bandwidth for one rank; latency in us"
    assert row[6] == f"{2 * (8 << 20) / 0.004 / 1e9:.2f}", "the copy column: read + write"


def test_the_doctor_runs_the_launch_command_with_its_worker(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    hostfile = os.path.join(GOLDEN, "two_hosts.hostfile")
    assert launcher.main(["--hostfile", hostfile, "--master-port", "29611", "--dry-run", "--doctor", "--",
                          *TRAIN_ARGS]) == 0
    out = capsys.readouterr().out
    assert ("--master_addr 127.0.0.1 --master_port 29611 --no_ssh_check --module finetune.multinode.doctor_worker "
            "--rank-hosts 127.0.0.1,127.0.0.2 --timeout 60\n") in out
    assert "main.py" not in out and "dry run: nothing started" in out
    args, train_args = launcher._parse_args(["--hostfile", hostfile, "--", *TRAIN_ARGS])
    plan = launcher.build_plan(args, train_args, dict(os.environ))
    quick = doctor.doctor_command(plan, quick=True, timeout=20)
    assert quick[: len(plan.command) - len(TRAIN_ARGS) - 1] == plan.command[: -len(TRAIN_ARGS) - 1]
    assert quick[-7:] == ["--module", "finetune.multinode.doctor_worker", "--rank-hosts", "127.0.0.1,127.0.0.2",
                          "--timeout", "20", "--quick"]
