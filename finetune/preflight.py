"""Check every host before a launch, in parallel, each within 10 s, and print the answers as a table.

    report = run_preflight(hosts, Transport("ssh"), output_dir="runs/x", master_addr="10.0.0.1", master_port=29617)
    print(report.table()); sys.exit(0 if report.ok else 1)

Per host: reachable (ssh in batch mode, or srun under Slurm); the same python, torch, deepspeed and zerotune
versions, git commit and package source as the first host; the output dir writable (and whether it is one
shared folder: a marker written on the first host is looked for on the others); the master port free on the
first host; accelerators >= slots where the host has accelerators.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

PROBE_TIMEOUT_S = 10.0
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
_TAG = "ZEROTUNE_PREFLIGHT "
_NO_CWD, _NO_PYTHON = 97, 98
_SAME_EVERYWHERE = ("python", "torch", "deepspeed", "zerotune", "commit", "source")
_COLUMNS = ("host", "reach", *_SAME_EVERYWHERE, "output dir", "port", "accelerators")

# Runs on each host: versions, a digest of the package source, output dir writable, master port free, GPU count.
_PROBE = r"""
import errno, hashlib, json, os, platform, socket, subprocess, sys
from importlib import metadata
a = json.loads(sys.argv[1])
r = {"python": platform.python_version()}
for name in ("torch", "deepspeed"):
    try:
        r[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        r[name] = "missing"
try:
    import finetune
    r["zerotune"] = finetune.__version__
except ImportError:
    r["zerotune"] = "missing"
try:
    git = subprocess.run(["git", "-C", a["repo"], "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, timeout=5)
    r["commit"] = git.stdout.strip() or "none"
except (OSError, subprocess.TimeoutExpired):
    r["commit"] = "no git"
digest, package = hashlib.sha256(), os.path.join(a["repo"], "finetune")
for root, dirs, files in os.walk(package):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
        path = os.path.join(root, name)
        digest.update(os.path.relpath(path, package).encode())
        with open(path, "rb") as f:
            digest.update(f.read())
r["source"] = digest.hexdigest()[:8]
try:
    os.makedirs(a["output_dir"], exist_ok=True)
    with open(a["marker"], "w") as f:
        f.write(socket.gethostname())
    if not a["keep_marker"]:
        os.remove(a["marker"])
    r["output dir"] = "ok"
except OSError as e:
    r["output dir"] = "not writable: " + str(e)
if a["port"]:
    s = socket.socket()
    try:
        s.bind((a["addr"], a["port"]))
        r["port"] = "free"
    except OSError as e:
        r["port"] = "%d in use" % a["port"] if e.errno == errno.EADDRINUSE else "cannot bind %s: %s" % (a["addr"], e.strerror)
    finally:
        s.close()
r["accelerators"] = 0
if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"):  # importing torch on a CPU node costs seconds
    try:
        import torch
        r["accelerators"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        pass
print("ZEROTUNE_PREFLIGHT " + json.dumps(r), flush=True)
"""


@dataclass
class Transport:
    """How to run a shell command on a host: `ssh` (batch mode), `srun` (inside a Slurm job) or `local`."""

    kind: Literal["ssh", "srun", "local"]

    def argv(self, host: str, script: str) -> list[str]:
        if self.kind == "ssh":
            return ["ssh", *SSH_OPTIONS, host, script]
        if self.kind == "srun":
            return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--kill-on-bad-exit=1", "sh", "-c", script]
        return ["sh", "-c", script]


@dataclass
class HostRow:
    host: str
    cells: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """`check: what is wrong and what to do`, one per failed check."""


@dataclass
class PreflightReport:
    rows: list[HostRow]
    warnings: list[str]
    seconds: float

    @property
    def ok(self) -> bool:
        return not any(row.problems for row in self.rows)

    def table(self) -> str:
        """The table, then one `FAIL host check: ...` line per problem and one `warning:` line per warning."""
        grid = [list(_COLUMNS)] + [[row.host] + [row.cells.get(c, "-") for c in _COLUMNS[1:]] for row in self.rows]
        widths = [max(len(line[i]) for line in grid) for i in range(len(_COLUMNS))]
        lines = [f"preflight: {len(self.rows)} host(s), {self.seconds:.1f} s"]
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in grid]
        lines += [f"FAIL {row.host} {problem}" for row in self.rows for problem in row.problems]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def run_preflight(
    hosts: dict[str, int],
    transport: Transport,
    *,
    output_dir: str,
    master_addr: str,
    master_port: int,
    cwd: str | None = None,
    python: str = sys.executable,
    repo: str | None = None,
) -> PreflightReport:
    """Probe all hosts in parallel; the first host also checks the master port and keeps a marker for the shared-dir test."""
    start = time.monotonic()
    cwd = cwd or os.getcwd()
    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = list(hosts)
    marker = os.path.join(output_dir, f".zerotune-preflight-{uuid.uuid4().hex[:12]}")

    def probe(index: int) -> HostRow:
        args = {
            "repo": repo,
            "output_dir": output_dir,
            "marker": marker if index == 0 else f"{marker}.{index}",
            "keep_marker": index == 0 and len(names) > 1,
            "port": master_port if index == 0 else 0,
            "addr": master_addr,
        }
        script = (
            f"cd {shlex.quote(cwd)} 2>/dev/null || exit {_NO_CWD}; test -x {shlex.quote(python)} || exit {_NO_PYTHON}; "
            f"PYTHONPATH={shlex.quote(repo)} exec {shlex.quote(python)} -c {shlex.quote(_PROBE)} {shlex.quote(json.dumps(args))}"
        )
        return _check_host(names[index], hosts[names[index]], transport, script, cwd=cwd, python=python, repo=repo)

    with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
        rows = list(pool.map(probe, range(len(names))))
        _compare(rows)
        warnings = []
        if rows[0].cells.get("output dir") == "ok" and len(rows) > 1:
            warnings = _shared_dir(rows, transport, pool, marker, cwd)
    return PreflightReport(rows, warnings, time.monotonic() - start)


def _run(transport: Transport, host: str, script: str) -> tuple[int | None, str, str]:
    """(returncode or None on timeout, stdout, stderr) of one command on one host, never longer than PROBE_TIMEOUT_S."""
    try:
        done = subprocess.run(
            transport.argv(host, script), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return None, "", ""
    except FileNotFoundError as e:
        return 127, "", f"{e.filename} not found: install it on the launching machine"
    return done.returncode, done.stdout, done.stderr


def _check_host(host: str, slots: int, transport: Transport, script: str, *, cwd: str, python: str, repo: str) -> HostRow:
    row = HostRow(host)
    code, out, err = _run(transport, host, script)
    how = transport.kind
    last_error = (err.strip().splitlines() or ["no message"])[-1]
    if code is None:
        row.cells["reach"] = "timeout"
        row.problems.append(f"reach: no answer from {how} within {PROBE_TIMEOUT_S:.0f} s; is the host up and reachable?")
        return row
    if code == _NO_CWD:
        row.cells["reach"] = "ok"
        row.problems.append(f"reach: directory {cwd} does not exist there; the repo must be at the same path on every node")
        return row
    if code == _NO_PYTHON:
        row.cells["reach"] = "ok"
        row.problems.append(f"python: {python} does not exist there; install the same environment at the same path on every node")
        return row
    answer = next((line[len(_TAG) :] for line in out.splitlines() if line.startswith(_TAG)), None)
    if answer is None:
        row.cells["reach"] = "FAIL"
        if transport.kind == "ssh" and code == 255:
            hint = "set up passwordless ssh (`ssh-copy-id HOST`; `ssh -o BatchMode=yes HOST true` must work)"
        else:
            hint = f"the probe exited with code {code}"
        row.problems.append(f"reach: {how} failed: {last_error} ({hint})")
        return row
    row.cells["reach"] = "ok"
    facts = json.loads(answer)
    row.cells.update({k: str(v) for k, v in facts.items() if k != "accelerators"})
    if facts["zerotune"] == "missing" or not os.path.isfile(os.path.join(repo, "finetune", "main.py")):
        row.problems.append(f"zerotune: the package is not importable from {repo} there; check out the repo at the same path")
    if facts["output dir"] != "ok":
        row.problems.append(f"output dir: {facts['output dir']}; pick a train.output_dir every node can write")
    if "port" in facts and facts["port"] != "free":
        row.problems.append(f"port: {facts['port']} on the master host; pass --master-port with a free port, or --master-addr")
    count = int(facts["accelerators"])
    row.cells["accelerators"] = f"{count} (slots {slots})" if count else "0 (cpu)"
    if 0 < count < slots:
        row.problems.append(f"accelerators: {count} visible but the hostfile gives slots={slots}; lower slots or fix the driver")
    return row


def _compare(rows: list[HostRow]) -> None:
    """Mark cells that differ from the first host that answered; GPU nodes mixed with CPU nodes fail too."""
    answered = [row for row in rows if "python" in row.cells]
    if not answered:
        return
    reference = answered[0]
    for row in answered[1:]:
        for key in _SAME_EVERYWHERE:
            if row.cells[key] != reference.cells[key]:
                row.problems.append(
                    f"{key}: {row.cells[key]} here but {reference.cells[key]} on {reference.host}; "
                    f"every node must run the same environment and code"
                )
                row.cells[key] += " *"
        if row.cells["accelerators"].startswith("0 ") != reference.cells["accelerators"].startswith("0 "):
            row.problems.append(f"accelerators: {row.cells['accelerators']} here but {reference.cells['accelerators']} on {reference.host}")


def _shared_dir(rows: list[HostRow], transport: Transport, pool: ThreadPoolExecutor, marker: str, cwd: str) -> list[str]:
    """Look for the first host's marker on the others, then remove it; returns warnings for a dir that is not shared."""
    quoted, where = shlex.quote(marker), f"cd {shlex.quote(cwd)} || exit {_NO_CWD}; "
    script = where + f"test -e {quoted} && echo shared || echo local"
    others = [row for row in rows[1:] if row.cells.get("output dir") == "ok"]
    answers = list(pool.map(lambda row: _run(transport, row.host, script)[1].strip(), others))
    _run(transport, rows[0].host, where + f"rm -f {quoted}")
    shared = all(answer == "shared" for answer in answers)
    for row, answer in zip([rows[0], *others], [("shared" if shared else "local"), *answers]):
        row.cells["output dir"] = f"ok, {answer or 'unknown'}"
    if shared:
        return []
    return [
        f"the output dir {os.path.dirname(marker) or '.'} is not one shared folder: each node keeps its own "
        f"checkpoint shards; put train.output_dir on shared storage to resume or export the model"
    ]
