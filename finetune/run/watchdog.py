"""No silent hangs: a thread in every rank that ends the run when no step finishes for train.stall_timeout_s, naming
the rank that is stuck, its host, its phase and its collective.

    with watchdog.watching(t.output_dir, t.stall_timeout_s):   # around the loop, once the run folder exists
        ...

Every few seconds each rank's thread writes its progress record (finetune/run/activity.py) as a heartbeat file,
<output_dir>/stall/beat_rank_<K>.json. When its own rank has made no progress for the limit, it writes its Python
stacks (every thread) and its record to stall/rank_<K>.txt (and torch's flight recorder to rank_<K>.fr.json), then
reads every rank's heartbeat twice, a few beats apart: a rank whose heartbeat did not move is not responding (a
stopped or hung process stops its threads too), a rank that passed fewer collectives or steps to the backend is
behind. The lowest rank still responding prints one summary (also written to stall/summary.txt) and every running
rank exits with code 4; the launcher stops what is left. The summary needs the heartbeats of every node, i.e. an
output_dir on a file system the nodes share; without one, each node's lowest running rank summarises what it sees,
and every rank still writes its own stack file and exits.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any

from finetune.run import activity, console
from finetune.run import folder as run_folder
from finetune.run import folder_lock
from finetune.run.activity import ACTIVITY

STALL_EXIT = 4
FLOOR_S = 300.0
"""`auto`: the least limit once steps have been timed."""
STEP_MULTIPLE, MARGIN_S = 10.0, 60.0
"""`auto`: the limit is STEP_MULTIPLE x the median step time of this run plus MARGIN_S (at least FLOOR_S)."""
LONG_S = 1800.0
"""`auto`: the limit before this run's first step finished (loading, the first compile and gathers) and for a whole
save, sample or export, which take many steps' time."""
LONG_PHASES = ("start", "sample", "save", "export", "finish")
SUMMARY_WAIT_S = 30.0
"""How long a rank that does not summarise waits for the summary before it exits (a launcher stops every rank
once one exits)."""


def limit_s(setting: float | str | None, step_times: list[float], phase: str) -> float | None:
    """Seconds without progress that end the run: the explicit setting, or for `auto`/null a multiple of this run's
    median step time; None when the watchdog is off (0)."""
    if setting not in (None, "auto"):
        return float(setting) or None
    if phase in LONG_PHASES or not step_times:
        return LONG_S
    return max(FLOOR_S, STEP_MULTIPLE * statistics.median(step_times) + MARGIN_S)


def beat_s(limit: float) -> float:
    """Seconds between heartbeats: many beats per limit, few writes to a shared file system."""
    return min(10.0, max(0.25, limit / 10))


@contextlib.contextmanager
def watching(output_dir: str, setting: float | str | None):
    """Watch this rank while the block runs (nothing when setting is 0)."""
    dog = Watchdog(output_dir, setting)
    dog.start()
    try:
        yield dog
    finally:
        dog.stop()


def enable_flight_recorder(setting: float | str | None) -> None:
    """Ask torch to keep its flight recorder of collectives (read in a stall): before the process group starts."""
    if setting != 0 and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")


class Watchdog:
    def __init__(self, output_dir: str, setting: float | str | None):
        self.folder = run_folder.path(output_dir, run_folder.STALL)
        self.setting = setting
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def beat_path(self) -> str:
        return os.path.join(self.folder, f"beat_rank_{self.rank}.json")

    def start(self) -> None:
        if self.setting == 0:
            return
        ACTIVITY.reset()
        os.makedirs(self.folder, exist_ok=True)
        earlier = [f"rank_{self.rank}.txt", f"rank_{self.rank}.fr.json"] + ([run_folder.STALL_SUMMARY] if self.rank == 0 else [])
        for name in earlier:  # an earlier stall's, in a resumed run's folder
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.folder, name))
        activity.install()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="zerotune-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        activity.uninstall()
        with contextlib.suppress(OSError):
            os.remove(self.beat_path)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)  # the last rank out removes it, unless a stall left files there

    def _run(self) -> None:
        while True:
            limit = limit_s(self.setting, ACTIVITY.step_times, ACTIVITY.phase) or LONG_S
            if self._stop.wait(beat_s(limit)):
                return
            self._beat()
            if time.monotonic() - ACTIVITY.last_progress > limit:
                self._on_stall(limit)

    def _record(self) -> dict[str, Any]:
        return {"rank": self.rank, "world": self.world, "host": self.host, "pid": self.pid, "beat": self.beats,
                "time": time.time(), **ACTIVITY.snapshot()}

    def _beat(self) -> None:
        """Write this rank's heartbeat atomically (a reader never sees half a file)."""
        self.beats += 1
        with contextlib.suppress(OSError):  # a full or vanished disk must not end the run from here
            run_folder.write_text(self.beat_path, json.dumps(self._record()), durable=False)

    def _sleep_beating(self, seconds: float, beat: float, until=lambda: False) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not until():
            time.sleep(min(beat, max(0.0, end - time.monotonic())))
            self._beat()

    def _on_stall(self, limit: float) -> None:
        """Write this rank's stacks, name the ranks that are behind (the lowest rank still responding does), exit 4."""
        stalled_at, beat = time.time(), beat_s(limit)
        idle = time.monotonic() - ACTIVITY.last_progress
        self._write_stacks(limit, idle)
        first = read_beats(self.folder, self.world)
        self._sleep_beating(max(2.0, 3 * beat), beat)
        second = read_beats(self.folder, self.world)
        responding = [k for k in range(self.world) if k == self.rank or _moved(first[k], second[k])]
        summary_path = os.path.join(self.folder, run_folder.STALL_SUMMARY)
        if self.rank == min(responding):
            second[self.rank] = self._record()
            text = "\n".join(summary(first, second, self.rank, self.folder, self.setting, limit, idle)) + "\n"
            with contextlib.suppress(OSError):
                run_folder.write_text(summary_path, text)
            sys.stderr.write(text)
        else:
            def written() -> bool:
                with contextlib.suppress(OSError):
                    return os.path.getmtime(summary_path) >= stalled_at - SUMMARY_WAIT_S
                return False

            self._sleep_beating(SUMMARY_WAIT_S, beat, until=written)
        folder_lock.release_all()  # the training thread, stuck in a collective, never reaches train.main's release
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STALL_EXIT)

    def _write_stacks(self, limit: float, idle: float) -> None:
        record = self._record()
        path = os.path.join(self.folder, f"rank_{self.rank}.txt")
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(f"rank {self.rank} of {self.world}, host {self.host}, pid {self.pid}: no progress for "
                    f"{idle:.0f} s (limit {limit:.0f} s)\n{where(record)}\n"
                    f"collectives passed to the backend: {record['issued']}\n")
            fr = flight_recorder(include_collectives=False)
            if fr:
                f.write(f"torch flight recorder, per process group: {json.dumps(fr.get('pg_status'))}\n")
            f.write("\nPython stacks of every thread (most recent call first):\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        fr = flight_recorder(include_collectives=True)
        if fr:
            with contextlib.suppress(OSError), open(os.path.join(self.folder, f"rank_{self.rank}.fr.json"), "w") as f:
                json.dump(fr, f)


def flight_recorder(include_collectives: bool) -> dict[str, Any] | None:
    """torch's flight recorder of this process's collectives (TORCH_FR_BUFFER_SIZE), or None where it is off or
    this torch has none."""
    if "torch" not in sys.modules:
        return None
    try:
        from torch._C import _distributed_c10d as c10d  # lazy: present only in builds with distributed support

        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        found = json.loads(dump(includeCollectives=include_collectives)) if dump else None
    except (ImportError, RuntimeError, ValueError, TypeError):
        return None
    return found if found and found.get("pg_status") else None


def read_beats(folder: str, world: int) -> list[dict[str, Any] | None]:
    """Every rank's heartbeat (None: no file, or unreadable)."""
    found: list[dict[str, Any] | None] = []
    for k in range(world):
        try:
            with open(os.path.join(folder, f"beat_rank_{k}.json")) as f:
                found.append(json.load(f))
        except (OSError, ValueError):
            found.append(None)
    return found


def _moved(first: dict[str, Any] | None, second: dict[str, Any] | None) -> bool:
    return bool(first and second and second["beat"] != first["beat"])


def where(b: dict[str, Any], seconds: bool = True) -> str:
    """`step 13, phase forward, micro-batch 0, in all_reduce (not returned); 9 s in this phase` of one heartbeat."""
    text = f"step {b['step']}, phase {b['phase']}"
    if b.get("micro") is not None:
        text += f", micro-batch {b['micro']}"
    name = b.get("collective")
    text += {
        "": ", no collective yet",
        "entered": f", entering {name} (not yet passed to the backend)",
        "waiting": f", in {name} (not returned)",
        "async": f", last collective {name} (asynchronous: returned, waited on later)",
        "returned": f", last collective {name} (returned)",
        "raised": f", last collective {name} (raised)",
    }.get(b.get("state", ""), "")
    return text + (f"; {b.get('phase_for_s', 0):.0f} s in this phase" if seconds else "")


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> `0-2, 5, 7-8`."""
    runs: list[list[int]] = []
    for k in ranks:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def summary(first: list, second: list, rank: int, folder: str, setting, limit: float, idle: float) -> list[str]:
    """The summary of a stall by `rank` as lines: who is not responding, missing or behind, where each is, where the
    others wait, and what to check first. `first`/`second`: every rank's heartbeat (or None) read a few beats apart."""
    world = len(second)
    frozen = [k for k in range(world) if first[k] and second[k] and not _moved(first[k], second[k])]
    missing = [k for k in range(world) if second[k] is None]
    present = [k for k in range(world) if second[k] is not None]
    ahead = max(((second[k]["step"], second[k]["issued"]) for k in present), default=(0, 0))
    behind = [k for k in present if k not in frozen and (second[k]["step"], second[k]["issued"]) < ahead]
    me = second[rank]
    shown = "auto" if setting in (None, "auto") else f"{float(setting):g}"
    at = (f"after step {me['done']}" if me["done"] >= me["step"] else
          f"in step {me['step']} (the last finished: {me['done'] or 'none in this run'})")
    limit_text = "" if shown != "auto" else f", now {limit:.0f} s"
    lines = [console.error_line(f"stalled: no progress for {idle:.0f} s (train.stall_timeout_s: {shown}{limit_text}) "
             f"{at}; every running rank wrote its Python stacks to {folder}/rank_<K>.txt and exits with code "
             f"{STALL_EXIT}")]
    for k in frozen:
        b = second[k]
        age = max(0.0, time.time() - b["time"])
        lines.append(f"zerotune: stall: rank {k} (host {b['host']}, pid {b['pid']}) not responding, its heartbeat "
                     f"stopped {age:.0f} s ago; its last record: {where(b)}")
    for k in behind:
        b = second[k]
        lines.append(f"zerotune: stall: rank {k} (host {b['host']}, pid {b['pid']}) is behind (step {b['step']}, "
                     f"{b['issued']} collectives passed to the backend; the others are at step {ahead[0]}, "
                     f"{ahead[1]}): {where(b)}")
    for k in missing:
        lines.append(f"zerotune: stall: rank {k}: no heartbeat in {folder} (it ended, never started its watchdog, "
                     f"or output_dir is not shared by every node)")
    waiting: dict[str, list[int]] = {}  # one line for all ranks waiting at the same place
    for k in present:
        if k not in frozen and k not in behind:
            waiting.setdefault(where(second[k], seconds=False), []).append(k)
    for text, ranks in waiting.items():
        who = f"rank {ranks[0]} (host {second[ranks[0]]['host']})" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        lines.append(f"zerotune: stall: waiting: {who}: {text}")
    lines.append("zerotune: stall: check first: " + _advice(second, frozen, behind, missing, folder))
    return lines


def _advice(beats: list, frozen: list[int], behind: list[int], missing: list[int], folder: str) -> str:
    if frozen:
        b = beats[frozen[0]]
        return (f"rank {frozen[0]}'s process on {b['host']}: `ps -o pid,stat,cmd -p {b['pid']}` (stat T: stopped by a "
                f"signal or a debugger, `kill -CONT {b['pid']}`; D: waiting in the kernel on I/O or a driver), then "
                f"`py-spy dump --pid {b['pid']}`")
    if behind:
        b = beats[behind[0]]
        return (f"where rank {behind[0]} is: {folder}/rank_{behind[0]}.txt, or `py-spy dump --pid {b['pid']}` on "
                f"{b['host']} (phase data: the data loader; save or export: the file system)")
    if missing:
        return (f"whether {folder} is on a file system every node shares; each node's ranks wrote their stacks "
                f"there on their own node")
    names = sorted({b["collective"] for b in beats if b and b.get("collective")})
    return (f"every rank waits in {', '.join(names) or 'the same place'}: the network between the hosts "
            f"(NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME or GLOO_SOCKET_IFNAME) or a GPU that stopped (nvidia-smi); "
            f"compare the ranks' stacks in {folder}/rank_<K>.txt")
