"""One rank of the cluster doctor: join the process group, time a small all-reduce (latency), an all-to-all and a
large all-reduce (bus bandwidth), a local copy, and across nodes a send/receive to the next node; print the timings
as tagged JSON lines that finetune/multinode/doctor.py turns into the table.

    python -m finetune.multinode.doctor_worker --standalone     # this machine, one rank (one GPU): prints the table

`zerotune launch --doctor` starts it on every rank through the training's own runner (`--module`). It uses
torch.distributed directly, not DeepSpeed's init: it measures the fabric, and it starts in the time torch imports.
Each rank ends itself after --timeout seconds, saying in which stage it waited, so a lost peer never hangs it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as td

from finetune import dist
from finetune.multinode import doctor

SMALL_BYTES = 8  # the latency all-reduce: the smallest message nccl-tests times
SIZES = {"cpu": 8 << 20, "cuda": 256 << 20}  # the bandwidth buffers; the quick form uses a sixteenth
QUICK_DIVISOR = 16


class _Rank:
    """This rank's name in the report, its current stage, and a timer that ends the process when it overruns."""

    def __init__(self, rank: int, host: str, timeout: float, tagged: bool):
        self.rank, self.host, self.timeout, self.tagged, self.stage = rank, host, timeout, tagged, "start"
        timer = threading.Timer(timeout, self._expire)
        timer.daemon = True
        timer.start()

    def emit(self, **fields: object) -> None:
        """One tagged line in one write(): lines of ranks sharing the pipe never interleave."""
        if self.tagged:
            os.write(1, (doctor.TAG + json.dumps({"rank": self.rank, **fields}) + "\n").encode())

    def _expire(self) -> None:
        self.emit(error=f"still in stage '{self.stage}' after {self.timeout:.0f} s: a peer never answered", waited=True)
        print(f"doctor: rank {self.rank} on {self.host}: timed out in stage '{self.stage}'", file=sys.stderr, flush=True)
        os._exit(3)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.standalone:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(dist.free_port()))
        # One rank talks to no other machine: its process group stays on loopback (where none was chosen).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.adopt_openmpi_env()
    rank, world = dist.rank(), dist.world_size()
    hosts = args.rank_hosts.split(",") if args.rank_hosts else [socket.gethostname()] * world
    me = _Rank(rank, hosts[rank], args.timeout, tagged=not args.standalone)
    me.emit(stage="started")
    nccl_log = _log_nccl()  # before any NCCL call: NCCL reads its debug settings once
    start = time.monotonic()
    try:
        result = _measure(args, me, world, hosts, nccl_log)
    except Exception as e:  # noqa: BLE001 (any failure is this rank's report, then it exits non-zero)
        found = doctor.nccl_findings(doctor.parse_nccl_log(_read(nccl_log)), nodes=len(set(hosts)),
                                     environ=dict(os.environ), rdma_devices=_rdma_devices())[0]
        message = (str(e).strip().splitlines() or [""])[0][:300]
        waited = bool(re.search(r"time[ds]? ?out", message, re.I))  # gloo's and NCCL's own timeouts
        error = "; ".join([f"{me.stage}: {type(e).__name__}: {message}", *found])
        me.emit(error=error, waited=waited)
        if args.standalone:
            print(f"doctor: rank 0 on {hosts[0]}: {error}", file=sys.stderr, flush=True)
        _exit(1, nccl_log)
    me.emit(result=result)
    if args.standalone:
        report = doctor.DoctorReport({hosts[0]: [0]}, {0: {"result": result}}, seconds=time.monotonic() - start)
        print(report.table(), flush=True)
        _exit(0 if report.ok else 1, nccl_log)
    _exit(1 if result["problems"] else 0, nccl_log)
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m finetune.multinode.doctor_worker", description=__doc__.split("\n")[0])
    parser.add_argument("--standalone", action="store_true", help="run alone as rank 0 of 1 and print the table")
    parser.add_argument("--quick", action="store_true", help="smaller buffers, fewer repeats, no link test")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a rank gives up on its peers")
    parser.add_argument("--rank-hosts", default="", help="the host of each global rank, comma-separated")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # DeepSpeed's launcher adds it
    return parser.parse_args(argv)


def _measure(args: argparse.Namespace, me: _Rank, world: int, hosts: list[str], nccl_log: str) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", dist.local_rank()) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    nodes = list(dict.fromkeys(hosts))
    problems, warnings = doctor.ifname_problems(dict(os.environ), [n for _, n in socket.if_nameindex()], backend=backend)
    result = {"backend": backend, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "problems": problems, "warnings": warnings}
    if problems:  # joining would only fail later, and less clearly
        return result
    divisor = QUICK_DIVISOR if args.quick else 1
    iters, latency_iters = (2, 5) if args.quick else (5, 20)
    nbytes = SIZES[device.type] // divisor // (4 * world) * (4 * world)  # float32 elements, split evenly by all-to-all
    result.update(bytes=nbytes, iters=iters, small_bytes=SMALL_BYTES)
    start = time.monotonic()
    me.stage = "join"
    if cuda:
        torch.cuda.set_device(device)
    eager = {"device_id": device} if cuda else {}  # NCCL builds its communicator here, inside the timeout
    td.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout), **eager)
    me.emit(stage="joined")
    small = torch.zeros(SMALL_BYTES // 4, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    me.stage = "first all-reduce"
    td.all_reduce(small)
    sync()
    result["init_s"] = time.monotonic() - start
    me.stage = "latency"
    result["latency_s"] = statistics.median(_timed(lambda: td.all_reduce(small), 1, sync) for _ in range(latency_iters))
    big = torch.ones(nbytes // 4, device=device)
    out = torch.empty_like(big)

    def together(fn) -> float:  # every rank starts the timed loop at once; one untimed call warms the path up
        fn()
        td.all_reduce(small)
        sync()
        return _timed(fn, iters, sync)

    me.stage = "all-reduce"
    result["allreduce_s"] = together(lambda: td.all_reduce(big))
    me.stage = "all-to-all"
    result["alltoall_s"] = together(lambda: td.all_to_all_single(out, big))
    me.stage = "copy"
    out.copy_(big)  # one untimed copy: the first pays for the kernel's launch set-up
    result["copy_s"] = _timed(lambda: out.copy_(big), iters, sync)
    if len(nodes) > 1 and not args.quick:
        me.stage = "link to the next node"
        result["link"] = _link(me.rank, hosts, nodes, big, out, iters, sync)
    me.stage = "finish"
    td.barrier()
    if cuda:
        info = doctor.parse_nccl_log(_read(nccl_log))
        result["transport"] = doctor.describe_transport(info)
        more_problems, more_warnings = doctor.nccl_findings(
            info, nodes=len(nodes), environ=dict(os.environ), rdma_devices=_rdma_devices())
        problems += more_problems
        warnings += more_warnings
    else:
        result["transport"] = f"gloo tcp ({os.environ.get('GLOO_SOCKET_IFNAME') or 'any interface'})"
    return result


def _timed(fn, iters: int, sync) -> float:
    """Seconds per call of `fn`, over `iters` calls, after the device finished them all (and, before the clock
    starts, whatever was queued on it: that work is not this measurement's)."""
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def _link(rank: int, hosts: list[str], nodes: list[str], big, out, iters: int, sync) -> dict | None:
    """The first rank of each node sends `big` to the first rank of the next node (in hostfile order, a ring) while
    receiving from the previous one; the others skip. Seconds per exchange, and the node it sent to."""
    leaders = [hosts.index(node) for node in nodes]
    if rank not in leaders:
        return None
    i = leaders.index(rank)
    to, source = leaders[(i + 1) % len(leaders)], leaders[i - 1]

    def exchange() -> None:
        ops = [td.P2POp(td.isend, big, to), td.P2POp(td.irecv, out, source)]
        for work in td.batch_isend_irecv(ops):
            work.wait()

    exchange()
    sync()
    return {"to": hosts[to], "bytes": big.numel() * 4, "seconds": _timed(exchange, iters, sync)}


def _log_nccl() -> str:
    """Ask NCCL for its INIT and NET report in a file of this rank's own (not among the job's output)."""
    path = os.path.join(tempfile.gettempdir(), f"zerotune-doctor-nccl-{os.getpid()}.log")
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=path)
    return path


def _rdma_devices() -> list[str]:
    """InfiniBand/RoCE devices the kernel knows on this node."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _exit(code: int, nccl_log: str) -> None:
    """Remove the NCCL log and end without the interpreter's teardown (see dist.exit_process); no
    destroy_process_group: after a failure it can wait on the lost peer, and every rank passed the last barrier."""
    if os.path.exists(nccl_log):
        os.remove(nccl_log)
    dist.exit_process(code)


if __name__ == "__main__":
    main()
