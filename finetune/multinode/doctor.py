"""The cluster doctor: time an all-reduce and an all-to-all over every rank of a launch, read NCCL's own report of its
transport, and print bus bandwidth and latency per node, naming the slowest node and link and every rank that did
not answer.

    report = run_doctor(plan, doctor_command(plan, quick=False, timeout=60.0), timeout=60.0); print(report.table())

`zerotune launch --doctor` runs only this (after the preflight); a normal launch runs its quick form before training
unless `--no-doctor`. Each rank runs doctor_worker.py and prints tagged JSON lines; this side never imports torch.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from finetune.multinode.jobwatch import Failure, JobWatch, span
from finetune.multinode.jobwatch import next_line, pump_lines, stop_job
from finetune.multinode.plan import LaunchPlan

TAG = "ZEROTUNE_DOCTOR "
WORKER = "finetune.multinode.doctor_worker"
STARTUP_S = 30.0  # beyond the ranks' own timeout: the runner's start, ssh and each rank's imports
GRACE_S = 3.0  # after one rank failed, how long the others get to report before the job is stopped
_TAIL = 15
_SILENCE = {  # the last stage a rank that never answered reported -> what that says
    "": "never started (ssh, the python path or the runner failed there)",
    "started": "never joined the others",
    "joined": "stopped after joining",
}

_NCCL = {
    "version": re.compile(r"NCCL version (\S+)"),
    "network": re.compile(r"NCCL INFO Using network (.+?)\s*$"),
    "socket": re.compile(r"NET/Socket ?: Using (\[\d.*?)\s*$"),
    "ib": re.compile(r"NET/IB ?: Using (\[\d.*?)\s*$"),
    "ib_missing": re.compile(r"NET/IB ?: No device found"),
    "path": re.compile(r"Channel \d+(?:/\d+)? ?: \d+\[\w+\] -> \d+\[\w+\](?: \[(?:send|receive)\])? via (\S+)"),
    "nodes": re.compile(r"nNodes (\d+)"),
    "nvls": re.compile(r"NVLS multicast support is available|[1-9]\d* nvls channels"),
    "warn": re.compile(r"NCCL WARN (.+?)\s*$"),
}


def parse_nccl_log(text: str) -> dict:
    """What NCCL said about its transport (run with NCCL_DEBUG=INFO, NCCL_DEBUG_SUBSYS=INIT,NET): version, network
    plugin in use, socket interfaces, IB/RoCE devices, the channel paths (`NET/IB/GDRDMA`, `P2P/IPC`, `SHM/direct`,
    device numbers dropped), NVLS, how many nodes the communicator spans, and its WARN lines."""
    info: dict = {"version": "", "network": "", "socket_ifaces": [], "ib_devices": [], "ib_missing": False,
                  "paths": [], "nvls": False, "nodes": 0, "warnings": []}
    for line in text.splitlines():
        if m := _NCCL["version"].search(line):
            info["version"] = m[1]
        if m := _NCCL["network"].search(line):
            info["network"] = m[1]
        if m := _NCCL["socket"].search(line):
            info["socket_ifaces"] = re.findall(r"\[\d+\]([^:\s<]+):", m[1])
        if m := _NCCL["ib"].search(line):
            info["ib_devices"] = [f"{d}/{kind}" for d, kind in re.findall(r"\[\d+\]\s?([^:\s=\[{]+):\d+/(\w+)", m[1])]
        info["ib_missing"] |= bool(_NCCL["ib_missing"].search(line))
        if m := _NCCL["path"].search(line):
            path = "/".join(part for part in m[1].split("/") if not re.fullmatch(r"\d+(\(\d+\))?", part))
            if path not in info["paths"]:
                info["paths"].append(path)
        if m := _NCCL["nodes"].search(line):
            info["nodes"] = max(info["nodes"], int(m[1]))
        info["nvls"] |= bool(_NCCL["nvls"].search(line))
        if (m := _NCCL["warn"].search(line)) and m[1] not in info["warnings"]:
            info["warnings"].append(m[1])
    return info


def describe_transport(info: dict) -> str:
    """One cell: the network NCCL uses between nodes and the paths it built, e.g. `IB: NET/IB/GDRDMA, P2P/IPC, NVLS`."""
    if not (info["version"] or info["network"] or info["paths"]):
        return "NCCL (no INFO lines in its log)"
    network = info["network"] or ("Socket" if info["socket_ifaces"] and not info["ib_devices"] else "?")
    if network == "Socket" and info["socket_ifaces"]:
        network += f" ({','.join(info['socket_ifaces'])})"
    paths = info["paths"] + (["NVLS"] if info["nvls"] else [])
    return f"NCCL {info['version'] or '?'} {network}" + (f": {', '.join(paths)}" if paths else "")


def nccl_findings(info: dict, *, nodes: int, environ: dict[str, str], rdma_devices: list[str]) -> tuple[list, list]:
    """(problems, warnings) in NCCL's report: no usable socket interface; TCP sockets between nodes (a problem when
    this node has InfiniBand/RoCE devices NCCL did not use, else a warning); NCCL's own WARN lines."""
    problems, warnings = [], []
    ifname = environ.get("NCCL_SOCKET_IFNAME", "")
    if any("no socket interface found" in w for w in info["warnings"]):
        problems.append(f"NCCL found no usable network interface (NCCL_SOCKET_IFNAME={ifname or 'unset'}); "
                        "set NCCL_SOCKET_IFNAME to the interface that reaches the other nodes")
    between = [p for p in info["paths"] if p.startswith("NET/")]
    over_socket = any(p.startswith("NET/Socket") for p in between) or (not between and info["network"] == "Socket")
    if nodes > 1 and over_socket:
        if environ.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
            warnings.append("NCCL uses TCP sockets between nodes because NCCL_IB_DISABLE is set; unset it if the "
                            "nodes have InfiniBand/RoCE")
        elif rdma_devices:
            problems.append(f"NCCL fell back to TCP sockets between nodes although this node has {', '.join(rdma_devices)}"
                            "; check NCCL_IB_HCA, the rdma-core/libibverbs install and the NCCL net plugin")
        else:
            warnings.append("NCCL uses TCP sockets between nodes (no InfiniBand/RoCE device here): expect far less "
                            "bandwidth than over RDMA")
    warnings += [f"NCCL WARN {w}" for w in info["warnings"][:3] if "no socket interface found" not in w]
    return problems, warnings


def ifname_problems(environ: dict[str, str], interfaces: list[str], *, backend: str) -> tuple[list, list]:
    """(problems, warnings): NCCL/GLOO_SOCKET_IFNAME naming no interface of this node. NCCL reads a comma list of
    prefixes (`=` before the list: exact names, `^`: names to avoid); gloo reads exact names. A wrong name for the
    backend in use is a problem; for the other one, a warning."""
    problems, warnings = [], []
    for key, kind in (("NCCL_SOCKET_IFNAME", "nccl"), ("GLOO_SOCKET_IFNAME", "gloo")):
        value = environ.get(key, "")
        if not value or _interface_matches(value, interfaces, exact=kind == "gloo"):
            continue
        text = f"{key}={value} names no interface of this node (it has {', '.join(interfaces) or 'none'}); " \
               "set it to the one that reaches the other nodes, or unset it"
        (problems if kind == backend else warnings).append(text)
    return problems, warnings


def _interface_matches(value: str, interfaces: list[str], *, exact: bool) -> bool:
    if exact:
        return all(name in interfaces for name in value.split(","))
    avoid = value.startswith("^")
    value = value.lstrip("^")
    exact = value.startswith("=")
    names = [n.split(":")[0] for n in value.lstrip("=").split(",") if n]
    matched = [i for i in interfaces if any(i == n if exact else i.startswith(n) for n in names)]
    return len(matched) < len(interfaces) if avoid else bool(matched)


def bus_bandwidth(kind: str, nbytes: float, seconds: float | None, world: int) -> float | None:
    """GB/s as nccl-tests define it: algbw = bytes / time; all-reduce moves 2(n-1)/n of it per rank over the busiest
    link, all-to-all (n-1)/n. None for one rank: nothing crosses a link."""
    if not seconds or world < 2:
        return None
    factor = 2 * (world - 1) / world if kind == "all-reduce" else (world - 1) / world
    return nbytes / seconds / 1e9 * factor


def doctor_command(plan: LaunchPlan, *, quick: bool, timeout: float) -> list[str]:
    """The plan's own launch command (runner, hosts, ports, .deepspeed_env) with the doctor's worker as the module
    every rank runs instead of the training script."""
    head = plan.command[: len(plan.command) - len(plan.train_args) - 1]
    rank_hosts = [host for host, ranks in plan.ranks().items() for _ in ranks]
    worker = ["--module", WORKER, "--rank-hosts", ",".join(rank_hosts), "--timeout", f"{timeout:g}"]
    return head + worker + (["--quick"] if quick else [])


@dataclass
class DoctorReport:
    ranks: dict[str, list[int]]
    """Global ranks per host, as the launch places them."""
    records: dict[int, dict] = field(default_factory=dict)
    """Per rank: `stage` (started, joined), `result` (its timings) or `error`, as the rank printed them."""
    lost: list[Failure] = field(default_factory=list)
    """Ranks the runner reported lost (pdsh, mpirun, srun)."""
    stopped: str = ""
    """Why the doctor stopped the job at its deadline, or how the launch itself failed ('' when neither)."""
    cut_short: bool = False
    """The job was stopped after a failure: ranks still waiting on the failed one have nothing to add, unless that
    failure was a rank tired of waiting (`waited`): then the silent ones are whom it waited for."""
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)

    def feed(self, line: str) -> None:
        """Take one line of the job's output: a rank's tagged record (after pdsh's `host: ` prefix), or other text."""
        at = line.find(TAG)
        if at < 0:
            if line.strip() and "[INFO]" not in line:  # DeepSpeed's runner logs each step of the launch at INFO
                self.tail = (self.tail + [line.rstrip()])[-_TAIL:]
            return
        try:
            record = json.loads(line[at + len(TAG):])
        except json.JSONDecodeError:
            return
        self.records.setdefault(int(record.pop("rank")), {}).update(record)

    def host_of(self, rank: int) -> str:
        return next((host for host, ranks in self.ranks.items() if rank in ranks), "?")

    @property
    def results(self) -> dict[int, dict]:
        return {r: rec["result"] for r, rec in sorted(self.records.items()) if "result" in rec}

    def failed(self) -> bool:
        """A rank reported an error or a failed check: the others will wait on it."""
        return any("error" in rec or rec.get("result", {}).get("problems") for rec in self.records.values())

    def problems(self) -> list[str]:
        """`host rank r: what is wrong`, one per problem; ranks that never answered named with the last stage seen."""
        out = [f"{self.host_of(r)} rank {r}: {p}" for r, res in self.results.items() for p in res.get("problems", [])]
        out += [f"{self.host_of(r)} rank {r}: {rec['error']}" for r, rec in sorted(self.records.items()) if "error" in rec]
        silent = {r for ranks in self.ranks.values() for r in ranks if not {"result", "error"} & set(self.records.get(r, {}))}
        lost = [f for f in self.lost if silent & set(self.ranks.get(f.host, []))]  # the others said why themselves
        out += [str(failure) for failure in lost]
        waited = any(rec.get("waited") for rec in self.records.values())
        for host, ranks in self.ranks.items():
            if host in {f.host for f in lost} or (self.cut_short and not waited):
                continue
            for stage, what in _SILENCE.items():
                quiet = [str(r) for r in ranks if r in silent and self.records.get(r, {}).get("stage", "") == stage]
                if quiet:
                    out.append(f"{host} rank {','.join(quiet)}: no answer: {what}")
        if self.stopped:
            out.append(self.stopped)
        return out

    @property
    def ok(self) -> bool:
        return not self.problems()

    def table(self) -> str:
        """Per node: bus bandwidth of the all-reduce and the all-to-all, latency, the link to the next node, a local
        copy, the transport; then the slowest node and link, FAIL and warning lines, and the verdict."""
        results, world = self.results, sum(map(len, self.ranks.values()))
        first = next((x for x in results.values() if "latency_s" in x), {})
        head = f"doctor: {len(self.ranks)} node(s), {world} rank(s)"
        if "latency_s" in first:
            head += (f", {first['backend']} on {first['device']}; all-reduce and all-to-all of {first['bytes'] / 2**20:g}"
                     f" MiB x {first['iters']}; latency: median {first['small_bytes']}-byte all-reduce")
        lines = [f"{head}; {self.seconds:.1f} s",
                 "  (GB/s: bus bandwidth as nccl-tests define it; copy: read + write of one local buffer copy; "
                 "join: process group and first all-reduce)"]
        columns = ("node", "ranks", "all-reduce GB/s", "all-to-all GB/s", "latency us", "link GB/s", "copy GB/s",
                   "join s", "transport")
        rows, figures, links = [list(columns)], {}, []
        for host, ranks in self.ranks.items():
            mine = [results[r] for r in ranks if r in results]
            timed = [x for x in mine if "latency_s" in x]  # a rank that failed a check before joining has no timings
            ar = _worst([bus_bandwidth("all-reduce", x["bytes"], x["allreduce_s"], world) for x in timed], min)
            a2a = _worst([bus_bandwidth("all-to-all", x["bytes"], x["alltoall_s"], world) for x in timed], min)
            lat = _worst([x["latency_s"] * 1e6 for x in timed], max)
            copy = _worst([2 * x["bytes"] / x["copy_s"] / 1e9 for x in timed if x["copy_s"]], min)
            init = _worst([x["init_s"] for x in timed], max)
            link = next((x["link"] for x in timed if x.get("link")), None)
            link_text = "-"
            if link:
                links.append((x := link["bytes"] / link["seconds"] / 1e9, f"{host} -> {link['to']}"))
                link_text = f"{x:.2f} to {link['to']}"
            figures[host] = (ar, lat)
            rows.append([host, span(ranks), _num(ar), _num(a2a), _num(lat, 0), link_text, _num(copy), _num(init),
                         mine[0].get("transport", "-") if mine else "no answer"])
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        measured = {h: f for h, f in figures.items() if f[0] is not None}
        if len(measured) > 1:
            host, (ar, lat) = min(measured.items(), key=lambda item: item[1][0])
            slowest = f"slowest node: {host} (all-reduce {ar:.2f} GB/s, latency {lat:.0f} us)"
            late, (_, most) = max(measured.items(), key=lambda item: item[1][1])
            lines.append(slowest + (f"; highest latency: {late} ({most:.0f} us)" if late != host else ""))
        if links:
            gbps, name = min(links)
            lines.append(f"slowest link: {name} ({gbps:.2f} GB/s)")
        if world == 1 and first:
            lines.append("one rank: nothing to compare across ranks or nodes; bus bandwidth needs two ranks, so the "
                         "copy column is this device's own figure")
        lines += [f"FAIL {p}" for p in self.problems()]
        lines += [f"warning: {self.host_of(r)} rank {r}: {w}" for r, res in results.items() for w in res.get("warnings", [])]
        if not self.ok and self.tail and len(results) < world:
            lines += ["last output of the launch:"] + [f"  {line}" for line in self.tail]
        lines.append("doctor: ok" if self.ok else f"doctor: {len(self.problems())} problem(s)")
        return "\n".join(lines)


def _drain(lines: queue.Queue) -> str | None:
    try:
        return lines.get(timeout=0.1)
    except queue.Empty:
        return None


def _worst(values: list, pick) -> float | None:
    values = [v for v in values if v is not None]
    return pick(values) if values else None


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_doctor(plan: LaunchPlan, command: list[str], *, timeout: float) -> DoctorReport:
    """Run `command` (doctor_command's) with the plan's environment and read every rank's records. When one rank
    fails, the others get GRACE_S; past the ranks' own timeout plus STARTUP_S the job is stopped on every host."""
    start = time.monotonic()
    report, watch = DoctorReport(plan.ranks()), JobWatch(plan.ranks())
    proc = subprocess.Popen(
        command, env={**os.environ, **plan.exports(), **plan.command_env}, text=True, errors="replace",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, bufsize=1, start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=pump_lines, args=(proc.stdout, lines), daemon=True).start()
    deadline, stop_at = start + timeout + STARTUP_S, None
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None  # as Ctrl-C
    try:
        while True:
            line = next_line(lines)
            if line is None or (line == "" and proc.poll() is not None):  # the end, or the runner gone and all quiet
                break
            report.feed(line)
            if line and (failure := watch.feed(line)):
                report.lost.append(failure)
            now = time.monotonic()
            if stop_at is None and (report.failed() or watch.failures):
                stop_at = now + GRACE_S
            if now > deadline or (stop_at is not None and now > stop_at):
                report.cut_short = stop_at is not None and now > stop_at
                if not report.cut_short:
                    report.stopped = f"no verdict within {timeout + STARTUP_S:.0f} s: the job was stopped on every host"
                stop_job(plan, proc)
                break
    except KeyboardInterrupt:
        report.stopped = "interrupted: the job was stopped on every host"
        stop_job(plan, proc)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    code = proc.wait()
    while (line := _drain(lines)) is not None:  # what the ranks printed before the job ended or was stopped
        report.feed(line)
    if code and not report.problems():
        report.stopped = f"the launch exited with code {code}"
    report.seconds = time.monotonic() - start
    return report
