"""One run per output folder: global rank 0 holds `<output_dir>/.zerotune.lock` for the run's whole life.

    lock = folder_lock.acquire("runs/x")   # ConfigError naming the holder when another live run has the folder
    ...
    folder_lock.release_all()              # also registered with atexit

Two guards, because neither holds on every file system. An exclusive flock: the kernel drops it however its holder
dies (kill -9 included), so a free flock is the surest sign the holder is gone. But NFS mounted without lock support
lets every flock succeed, so the file also carries a record of its holder (host, PID, the process's start tick, boot
id, start time) whose mtime a daemon thread keeps touching: a record whose process is gone (same host) or whose
heartbeat is stale (another host, where the PID cannot be checked) belongs to a dead run and is taken over.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from finetune.config import ConfigError
from finetune.run import folder as run_folder

LOCK_FILE = run_folder.LOCK
HEARTBEAT_S = 5.0
"""How often the holder touches the lock file."""
STALE_AFTER_S = 120.0
"""A holder on another host whose heartbeat is older than this is taken as dead; many heartbeats, so that a busy
host or a slow file system is never mistaken for a dead run."""
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
"""flock's answers on a file system that does not support it (NFS without its lock service, some FUSE mounts)."""
RECORD_WAIT_S = 2.0
"""How long to wait for a record being written: a run that has just created the file writes it right after."""
RELEASE_WAIT_S = 30.0
"""How long a flock may stay held after its holder has exited: the kernel drops it when the last thread of the
process has closed its files, and a thread killed in the middle of a write (kill -9 during a save) finishes that
write first, while the process already shows as exited."""


@dataclass
class RunLock:
    """The lock this process holds on one output folder; release() is idempotent."""

    folder: str
    path: str
    fd: int
    created_folder: bool
    _stop: threading.Event = field(default_factory=threading.Event)
    _released: bool = False

    def release(self) -> None:
        """Remove the lock file (only if it is still ours) and drop the flock; remove the folder if this run created
        it and nothing else is in it (a failed start leaves the folder as it found it)."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        try:
            if _same_file(self.fd, self.path):  # unlink before close: nobody may lock an inode about to vanish
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self.fd)
        _held.pop(self.folder, None)
        if self.created_folder:
            try:
                os.rmdir(self.folder)  # fails, as it should, unless the folder is empty
            except OSError:
                pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.fd)  # the inode we hold, even if someone renamed or replaced the path
            except OSError:
                pass


_held: dict[str, RunLock] = {}


def acquire(output_dir: str) -> RunLock:
    """Take the folder's lock (creating the folder if needed) or raise ConfigError naming the live holder.

    Re-entrant within a process: runs made one after another in one process (test drivers) share the lock."""
    folder = os.path.realpath(output_dir)
    if folder in _held:
        return _held[folder]
    created = not os.path.isdir(folder)
    path = os.path.join(folder, LOCK_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        # A retry follows a holder that released in between (it ends at once), or one that has exited and whose
        # flock the kernel has not dropped yet (RELEASE_WAIT_S).
        deadline = time.monotonic() + RELEASE_WAIT_S
        while (lock := _try_take(output_dir, folder, path, created, deadline)) is None:
            if time.monotonic() > deadline:
                raise ConfigError(f"train.output_dir {output_dir!r}: could not take its lock {path}; is another run "
                                  f"starting and stopping there?")
            time.sleep(0.05)
    except OSError as e:
        if created:
            _remove_empty(folder)
        raise ConfigError(f"train.output_dir {output_dir!r} is not writable ({e.strerror}): choose another folder or "
                          f"fix its permissions") from None
    _held[folder] = lock
    threading.Thread(target=lock._heartbeat, name="zerotune-folder-lock", daemon=True).start()
    return lock


def release_all() -> None:
    """Release every lock this process holds (at exit, and when a run ends)."""
    for lock in list(_held.values()):
        lock.release()


atexit.register(release_all)


def _try_take(output_dir: str, folder: str, path: str, created: bool, deadline: float) -> RunLock | None:
    """The lock, or None when the file changed under us or its exited holder's flock is not dropped yet (retry), or
    ConfigError when a live run holds it."""
    try:
        fd, new = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        try:
            fd, new = os.open(path, os.O_RDWR), False
        except FileNotFoundError:  # its holder released it just now
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in NO_FLOCK:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            record = _read_record(path, wait=True)
            if record and record.get("host") == socket.gethostname() and _gone(record, 0.0) and \
                    time.monotonic() < deadline:  # its holder has exited here; the kernel drops the flock soon
                return None
            raise ConfigError(_held_message(output_dir, path, record)) from None
        # A file system without flock at all: the record alone decides, below.
    if not _same_file(fd, path):  # the holder unlinked the file between our open and our flock
        os.close(fd)
        return None
    if not new:
        record = _read_record(path, wait=True)
        reason = _gone(record, os.stat(path).st_mtime) if record else "its record is empty"
        if reason is None:  # a live holder, and a file system whose flock does not exclude (NFS without locks)
            os.close(fd)
            raise ConfigError(_held_message(output_dir, path, record))
        print(f"zerotune: note: took over the lock of a run that is gone ({_describe(record)}; {reason}): {path}",
              flush=True)
    try:
        _write_record(fd)
    except OSError:
        os.close(fd)
        raise
    return RunLock(folder, path, fd, created)


def _gone(record: dict[str, Any], heartbeat: float) -> str | None:
    """Why the record's holder is dead, or None when it may be alive."""
    if record.get("host") != socket.gethostname():
        age = time.time() - heartbeat
        return f"no heartbeat for {age:.0f} s" if age > STALE_AFTER_S else None
    if record.get("boot_id") and record.get("boot_id") != _boot_id():
        return "the host has restarted since"
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "its record names no process"
    state, start = _proc_stat(pid)
    if state is None:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"PID {pid} has exited"
        except PermissionError:  # alive, another user's
            return None
        return None
    if state in ("gone", "Z", "X"):  # Z: exited, not yet reaped by its parent
        return f"PID {pid} has exited"
    if record.get("proc_start") is not None and start is not None and start != record["proc_start"]:
        return f"PID {pid} is now another process"
    return None


def _held_message(output_dir: str, path: str, record: dict[str, Any] | None) -> str:
    holder = _describe(record) if record else "a run whose record is not written yet"
    return (f"train.output_dir {output_dir!r} is in use by another run ({holder}; lock file {path}). Wait for it to "
            f"end or stop it, or choose another train.output_dir; to continue that run later, pass "
            f"train.resume=auto once it has stopped. If no such run exists, delete {path}")


def _describe(record: dict[str, Any] | None) -> str:
    if not record:
        return "holder unknown"
    return f"host {record.get('host')}, PID {record.get('pid')}, started {record.get('started')}"


def _write_record(fd: int) -> None:
    pid = os.getpid()
    record = {"host": socket.gethostname(), "pid": pid, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
              "boot_id": _boot_id(), "proc_start": _proc_stat(pid)[1]}
    data = json.dumps(record).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_record(path: str, wait: bool) -> dict[str, Any] | None:
    """The holder's record; with wait, give a holder that has just created the file time to write it."""
    deadline = time.monotonic() + (RECORD_WAIT_S if wait else 0.0)
    while True:
        try:
            with open(path) as f:
                record = json.loads(f.read())
            if isinstance(record, dict):
                return record
        except (OSError, ValueError):
            pass
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _same_file(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _proc_stat(pid: int) -> tuple[str | None, int | None]:
    """(state, start tick since boot) of a process from /proc: ("gone", None) when it is not there, (None, None)
    without /proc. The start tick tells a reused PID from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return (None, None) if not os.path.isdir("/proc/self") else ("gone", None)
    return fields[0], int(fields[19])


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _remove_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass
