"""Run a launch command and watch it: echo its output, and when one rank is lost, name its rank and host, give the
others a grace period, then stop this job's processes on every host. SIGTERM or SIGUSR1 (Slurm's `--signal`, a
scheduler's stop) is passed on to the ranks alone, which save and exit 0 (finetune/run/preempt.py); Ctrl-C stops the job.

    code = run_job(plan, grace=20.0)   # plan: finetune.multinode.plan.LaunchPlan
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

from finetune.multinode.plan import LaunchPlan

STOP_WAIT_S = 10.0
SAVE_WAIT_S = 600.0
"""How long the ranks get to finish their step, save and exit after a forwarded SIGTERM/SIGUSR1 before the job is
stopped (`zerotune launch --stop-timeout`)."""
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
# A host whose ranks had all ended when its signal came (they may have saved and exited after another host's signal).
NO_RANK_THERE = "no rank of this job running there"

# Runs over ssh on each host to stop this job only: the `deepspeed.launcher.launch` processes started with this
# job's master address and port, and everything under them (DeepSpeed's own stop is `pkill -f` on any launch).
_STOP_SNIPPET = r"""
import sys, psutil
want = {"deepspeed.launcher.launch", "--master_addr=" + sys.argv[1], "--master_port=" + sys.argv[2]}
procs = []
for p in psutil.process_iter(["cmdline"]):
    if want <= set(p.info["cmdline"] or []):
        try:
            procs += [p] + p.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
for p in procs:
    try:
        p.terminate()
    except psutil.NoSuchProcess:
        pass
for p in psutil.wait_procs(procs, timeout=5)[1]:
    p.kill()
"""

# Runs on each host to pass a stopping signal to this job's ranks alone: the processes started with this job's
# MASTER_ADDR and MASTER_PORT and a rank (RANK from DeepSpeed's launch.py, OMPI_COMM_WORLD_RANK from mpirun) in their
# environment, but not their own children; launch.py's ranks of this host only (CROSS_RANK, its node rank), should
# two "hosts" be one machine. Never launch.py or DeepSpeed's runner (nor pdsh, whose command line names launch.py):
# both die of SIGUSR1, and launch.py answers SIGTERM by killing the ranks, 30 s after the signal at most, whether their
# save has ended or not.
_FORWARD_SNIPPET = r"""
import sys, psutil
addr, port, signum, node = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def is_rank(p):
    try:
        env = p.environ()
    except (psutil.Error, AttributeError):
        return False
    return env.get("MASTER_ADDR") == addr and env.get("MASTER_PORT") == port and env.get("CROSS_RANK", node) == node and (
        "RANK" in env or "OMPI_COMM_WORLD_RANK" in env)
def parent(p):
    try:
        return p.parent()
    except psutil.Error:
        return None
ranks = [p for p in psutil.process_iter() if is_rank(p) and not is_rank(parent(p))]
for p in ranks:
    try:
        p.send_signal(signum)
    except psutil.NoSuchProcess:
        pass
print(len(ranks))
"""


def run_job(plan: LaunchPlan, *, grace: float, save_wait: float = SAVE_WAIT_S) -> int:
    """Run the command and echo its output; when a rank fails, give the others `grace` seconds, then stop them. A
    SIGTERM/SIGUSR1 goes on to the ranks, which get `save_wait` seconds to save and exit."""
    watch = JobWatch(plan.ranks())
    proc = subprocess.Popen(
        plan.command, env={**os.environ, **plan.exports(), **plan.command_env}, text=True, errors="replace",
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
        start_new_session=True,  # Ctrl-C reaches us only: DeepSpeed's runner answers it with `pkill -f`
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=pump_lines, args=(proc.stdout, lines), daemon=True).start()
    received: list[int] = []  # the handler only notes; the loop below acts within half a second
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in FORWARDED} if main_thread else {}
    failed_at, stopped, forwarded_at = None, False, None
    try:
        while (line := next_line(lines)) is not None:
            sys.stdout.write(line)
            sys.stdout.flush()
            if received and forwarded_at is None:
                name = signal.Signals(received[0]).name
                print(f"zerotune launch: {name}: passed on to every rank, which finishes its step, saves and exits "
                      f"(stopped after {save_wait:.0f} s otherwise)", flush=True)
                forward_signal(plan, received[0])
                forwarded_at = time.monotonic()
            if forwarded_at is not None and not stopped and time.monotonic() - forwarded_at > save_wait:
                print("zerotune launch: the ranks did not stop in time; stopping the job on every host", flush=True)
                stop_job(plan, proc)
                stopped = True
            if (failure := watch.feed(line)) and failed_at is None:
                failed_at = time.monotonic()
                print(f"zerotune launch: {failure}; the other ranks get {grace:.0f} s to stop", flush=True)
            if failed_at is not None and not stopped and time.monotonic() - failed_at > grace:
                print("zerotune launch: ranks still running; stopping the job on every host", flush=True)
                stop_job(plan, proc)
                stopped = True
        code = proc.wait()
    except KeyboardInterrupt:
        print("zerotune launch: interrupted; stopping the job on every host", flush=True)
        stop_job(plan, proc)
        return 130
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if watch.failures or code != 0:
        print(f"zerotune launch: job failed: {watch.summary() or 'the job ' + _exit_text(code)}", file=sys.stderr)
        return code or 1
    if received:
        later = f"; {len(received) - 1} later signal(s) ignored" if len(received) > 1 else ""
        print(f"zerotune launch: job stopped by {signal.Signals(received[0]).name}, saved{later}", flush=True)
    else:
        print("zerotune launch: job finished", flush=True)
    return 0


def pump_lines(stream: IO[str], lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def next_line(lines: queue.Queue) -> str | None:
    """The next line of output, '' after half a second of silence (so the grace clock still ticks), None at the end."""
    try:
        return lines.get(timeout=0.5)
    except queue.Empty:
        return ""


def forward_signal(plan: LaunchPlan, signum: int) -> None:
    """Send `signum` to this job's ranks on every host, and to nothing else of the job."""
    transport = plan.transport()

    def run(host: str) -> str:
        """'' when the signal reached at least one rank on `host`, else why not."""
        node = str(list(plan.hosts).index(host))  # DeepSpeed's node rank: the host's place in the hostfile
        script = shlex.join([sys.executable, "-c", _FORWARD_SNIPPET, plan.master_addr, str(plan.master_port),
                             str(signum), node])
        argv = transport.argv(host, script)
        if argv[0] == "srun":  # a step beside the training step, which holds the allocation's CPUs
            argv.insert(1, "--overlap")
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
        if done.returncode != 0:
            return done.stderr.strip() or f"exit code {done.returncode}"
        return "" if done.stdout.strip() not in ("", "0") else NO_RANK_THERE

    with ThreadPoolExecutor(max_workers=min(32, len(plan.hosts))) as pool:
        answers = dict(zip(plan.hosts, pool.map(run, plan.hosts)))
    for line in signal_report(answers):
        print(line, flush=True)


def signal_report(answers: dict[str, str]) -> list[str]:
    """What to print after forwarding a signal, from each host's answer ('' = reached). The ranks stop together
    (finetune/run/preempt.py: one rank's note reaches all of them in the step's sums), so once a host's ranks got the
    signal, another host whose ranks have already ended (they saved and left at that step while its signal was still
    on its way) is no problem; when no host was reached, every host's answer is one."""
    reached = any(problem == "" for problem in answers.values())
    return [f"zerotune launch: could not signal the ranks on {host} ({problem})" for host, problem in answers.items()
            if problem and not (reached and problem == NO_RANK_THERE)]


def stop_job(plan: LaunchPlan, proc: subprocess.Popen) -> None:
    """Stop this job only. pdsh: kill its processes on each host by master address and port, and never SIGTERM
    DeepSpeed's runner (its handler runs `pkill -f` on every DeepSpeed launch). Others: SIGTERM our process group."""
    if plan.launcher == "pdsh" and not plan.local:
        script = shlex.join([sys.executable, "-c", _STOP_SNIPPET, plan.master_addr, str(plan.master_port)])
        with ThreadPoolExecutor(max_workers=min(32, len(plan.hosts))) as pool:
            answers = pool.map(lambda host: plan.transport().run(host, script), plan.hosts)
            for host, (code, _, err) in zip(plan.hosts, answers):
                if code != 0:
                    print(f"zerotune launch: could not stop the ranks on {host} ({err.strip() or code}); check by hand")
    elif proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_WAIT_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of our own process group: runner, pdsh, ssh
    proc.wait()


@dataclass
class Failure:
    host: str
    ranks: list[int]
    how: str

    def __str__(self) -> str:
        who = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"a rank of {span(self.ranks)}"
        return f"{who} on {self.host} {self.how}"


class JobWatch:
    """Reads the job's output and recognises lost ranks as pdsh, mpirun and srun report them."""

    _PDSH = re.compile(r"^pdsh@\S+: (\S+): ssh exited with exit code (\d+)")
    _MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
    _MPI_NAME = re.compile(r"Process name:\s+\[\[\d+,\d+\],(\d+)\]")
    _MPI_CODE = re.compile(r"Exit code:\s+(\d+)")
    _SRUN = re.compile(r"srun: error: (\S+): tasks? [\d,-]+: (.+)")
    # A rank's stall watchdog (finetune/run/watchdog.py) naming a rank that is stuck; the launcher adds its host.
    _STALL = re.compile(r"zerotune: stall: rank (\d+) \(host \S+, pid \d+\) (.+)$")
    _PEER_GONE = re.compile(r"^(\S+): .*(Connection (closed|reset) by peer|Broken pipe|NCCL.*(abort|[Ww]atchdog))")

    def __init__(self, ranks: dict[str, list[int]]):
        self.ranks = ranks
        self.failures: list[Failure] = []
        self.followers: set[str] = set()
        """Hosts whose ranks said a peer went away: they failed because another one did."""
        self._mpi_rank: int | None = None

    def feed(self, line: str) -> Failure | None:
        """Take one line of output; return the failure it reports, if it is a new one."""
        if match := self._PEER_GONE.match(line):
            self.followers.add(match[1])
        failure = None
        if match := self._PDSH.match(line):
            failure = Failure(match[1], self.ranks.get(match[1], []), _exit_text(int(match[2]), ssh=True))
        elif match := self._MPI_SIGNAL.search(line):
            failure = Failure(match[2], [int(match[1])], f"was killed by signal {_signal_name(int(match[3]))}")
        elif match := self._MPI_NAME.search(line):
            self._mpi_rank = int(match[1])
        elif (match := self._MPI_CODE.search(line)) and self._mpi_rank is not None:
            rank, self._mpi_rank = self._mpi_rank, None
            host = next((h for h, ranks in self.ranks.items() if rank in ranks), "?")
            failure = Failure(host, [rank], _exit_text(int(match[1])))
        elif match := self._SRUN.search(line):
            failure = Failure(match[1], self.ranks.get(match[1], []), match[2].strip().lower())
        elif match := self._STALL.search(line):
            rank = int(match[1])
            host = next((h for h, ranks in self.ranks.items() if rank in ranks), "?")
            failure = Failure(host, [rank], f"stalled: {match[2].strip()}")
        if failure is None or any(f.host == failure.host and f.ranks == failure.ranks for f in self.failures):
            return None
        self.failures.append(failure)
        return failure

    def summary(self) -> str:
        """A stalled rank, else the first failure of a host that did not merely lose its peers; then the others."""
        if not self.failures:
            return ""
        first = next((f for f in self.failures if f.how.startswith("stalled")), None) or next(
            (f for f in self.failures if f.host not in self.followers), self.failures[0])
        rest = [str(f) for f in self.failures if f is not first]
        return str(first) + (f" (after it: {'; '.join(rest)})" if rest else "")


def _exit_text(code: int, ssh: bool = False) -> str:
    if ssh and code == 255:
        return "was lost: ssh exited with 255 (host down, network, or sshd)"
    if 128 < code < 192:
        return f"was killed by signal {_signal_name(code - 128)}"
    if code >= 192:  # DeepSpeed's launch exits with -signal, which the shell sees as 256 - signal
        return f"was killed by signal {_signal_name(256 - code)}"
    return f"exited with code {code}"


def _signal_name(number: int) -> str:
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


def span(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}" if ranks else "none"
