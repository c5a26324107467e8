"""Check every host before a launch, in parallel, each within 10 s, and report the answers as a table.

    report = run_preflight({"node1": 8, "node2": 8}, Transport("ssh"), output_dir="runs/x", master_addr="10.0.0.1",
                           master_port=29617)
    print(report.table()); sys.exit(0 if report.ok else 1)

Per host: reachable (ssh in batch mode, or srun inside a Slurm job); the same python, torch, deepspeed and zerotune
versions, git commit and package source digest as the first host; the output dir writable, and whether it is one
shared folder (a marker written on the first host is looked for on the others); the master port free on the first
host; accelerators >= slots where the host has accelerators.
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

from finetune import shipped

PROBE_TIMEOUT_S = 10.0
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
_TAG = "ZEROTUNE_PREFLIGHT "
_NO_CWD, _NO_PYTHON = 97, 98
_SAME_EVERYWHERE = ("python", "torch", "deepspeed", "zerotune", "commit", "source")
_COLUMNS = ("host", "reach", *_SAME_EVERYWHERE, "output dir", "port", "accelerators")

# Runs on each host; prints one tagged JSON line. Importing torch costs seconds, so only where a GPU device exists.
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
    git = subprocess.run(["git", "-C", a["repo"], "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True,
                         timeout=5)
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
    s = socket.socket(socket.AF_INET6 if ":" in a["addr"] else socket.AF_INET)
    try:
        s.bind((a["addr"], a["port"]))
        r["port"] = "free"
    except OSError as e:
        in_use = e.errno == errno.EADDRINUSE
        r["port"] = "%d in use" % a["port"] if in_use else "cannot bind %s: %s" % (a["addr"], e.strerror)
    finally:
        s.close()
r["accelerators"] = 0
if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd"):
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

    def run(self, host: str, script: str, timeout: float = PROBE_TIMEOUT_S) -> tuple[int | None, str, str]:
        """(exit code, or None when `timeout` passed; stdout; stderr) of `script` run by the shell on `host`."""
        try:
            done = subprocess.run(
                self.argv(host, script), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            return None, "", ""
        except FileNotFoundError as e:
            return 127, "", f"{e.filename} not found: install it on this machine"
        return done.returncode, done.stdout, done.stderr


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
    """Probe all hosts in parallel; the first also checks the master port and keeps a marker for the shared-dir test.

    Commands run in `cwd` (default: this one) with `python` (default: this one): both must exist on every host.
    """
    start = time.monotonic()
    cwd = cwd or os.getcwd()
    repo = repo or shipped.IMPORT_ROOT
    names = list(hosts)
    marker = os.path.join(output_dir, f".zerotune-preflight-{uuid.uuid4().hex[:12]}")

    def probe(index: int) -> HostRow:
        args = {
            "repo": repo, "output_dir": output_dir, "addr": master_addr,
            "marker": marker if index == 0 else f"{marker}.{index}",
            "keep_marker": index == 0 and len(names) > 1,
            "port": master_port if index == 0 else 0,
        }
        script = (
            f"cd {shlex.quote(cwd)} 2>/dev/null || exit {_NO_CWD}; test -x {shlex.quote(python)} || exit {_NO_PYTHON}; "
            f"PYTHONPATH={shlex.quote(repo)} exec {shlex.quote(python)} -c {shlex.quote(_PROBE)} "
            f"{shlex.quote(json.dumps(args))}"
        )
        return _check_host(names[index], hosts[names[index]], transport, script, cwd=cwd, python=python, repo=repo)

    with ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
        rows = list(pool.map(probe, range(len(names))))
        _compare(rows)
        warnings = []
        if len(rows) > 1 and rows[0].cells.get("output dir") == "ok":
            warnings = _shared_dir(rows, transport, pool, marker, cwd)
    return PreflightReport(rows, warnings, time.monotonic() - start)


def _check_host(
    host: str, slots: int, transport: Transport, script: str, *, cwd: str, python: str, repo: str
) -> HostRow:
    row = HostRow(host, {"reach": "ok"})
    code, out, err = transport.run(host, script)
    answer = next((line[len(_TAG) :] for line in out.splitlines() if line.startswith(_TAG)), None)
    if code is None:
        row.cells["reach"] = "timeout"
        row.problems.append(f"reach: no answer in {PROBE_TIMEOUT_S:.0f} s over {transport.kind}; is the host up?")
    elif code == _NO_CWD:
        row.problems.append(f"reach: no directory {cwd} there; launch from a path that exists on every node")
    elif code == _NO_PYTHON:
        row.problems.append(f"python: no {python} there; install the same environment at the same path everywhere")
    elif answer is None:
        row.cells["reach"] = "FAIL"
        row.problems.append(f"reach: {transport.kind} failed: {_last_line(err, code)} ({_hint(err)})")
    if answer is None:
        return row
    facts = json.loads(answer)
    row.cells.update({key: str(value) for key, value in facts.items() if key != "accelerators"})
    if facts["zerotune"] == "missing":
        row.problems.append(f"zerotune: not importable from {repo} there; check out the repo at the same path")
    if facts["output dir"] != "ok":
        row.problems.append(f"output dir: {facts['output dir']}; choose a train.output_dir every node can write")
    if facts.get("port", "free") != "free":
        row.problems.append(f"port: {facts['port']} on the master host; pass a free --master-port (or --master-addr)")
    count = int(facts["accelerators"])
    row.cells["accelerators"] = f"{count} (slots {slots})" if count else "0 (cpu)"
    if 0 < count < slots:
        row.problems.append(f"accelerators: {count} visible but slots={slots}; lower slots in the hostfile")
    return row


def _last_line(err: str, code: int) -> str:
    return (err.strip().splitlines() or [f"exit code {code}"])[-1]


def _hint(err: str) -> str:
    if "Permission denied" in err or "Host key verification failed" in err:
        return "set up passwordless ssh: `ssh-copy-id HOST`, then `ssh -o BatchMode=yes HOST true` must work"
    if "resolve hostname" in err:
        return "add the host to /etc/hosts or ~/.ssh/config"
    return "is the host up, sshd running, and the name right?"


def _compare(rows: list[HostRow]) -> None:
    """Fail cells that differ from the first host that answered; a CPU host among GPU hosts fails too."""
    answered = [row for row in rows if "python" in row.cells]
    if not answered:
        return
    reference = answered[0]
    for row in answered[1:]:
        for key in _SAME_EVERYWHERE:
            if row.cells[key] != reference.cells[key]:
                row.problems.append(
                    f"{key}: {row.cells[key]} here, {reference.cells[key]} on {reference.host}; "
                    "every node must run the same environment and code"
                )
                row.cells[key] += " *"
        if row.cells["accelerators"].startswith("0 ") != reference.cells["accelerators"].startswith("0 "):
            row.problems.append(
                f"accelerators: {row.cells['accelerators']} here, {reference.cells['accelerators']} on {reference.host}"
            )


def _shared_dir(
    rows: list[HostRow], transport: Transport, pool: ThreadPoolExecutor, marker: str, cwd: str
) -> list[str]:
    """Look for the first host's marker on the others, then remove it; warn when the folder is not shared."""
    where, quoted = f"cd {shlex.quote(cwd)} || exit {_NO_CWD}; ", shlex.quote(marker)
    others = [row for row in rows[1:] if row.cells.get("output dir") == "ok"]
    script = where + f"test -e {quoted} && echo shared || echo local"
    answers = list(pool.map(lambda row: transport.run(row.host, script)[1].strip() or "unknown", others))
    transport.run(rows[0].host, where + f"rm -f {quoted}")
    shared = all(answer == "shared" for answer in answers)
    for row, answer in zip([rows[0], *others], ["shared" if shared else "local", *answers]):
        row.cells["output dir"] = f"ok, {answer}"
    if shared:
        return []
    return [
        f"the output dir {os.path.dirname(marker)} is not one shared folder: each node keeps its own checkpoint "
        "shards; put train.output_dir on shared storage to resume or export the model"
    ]
