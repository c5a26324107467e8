"""One run per output folder (finetune/run/folder_lock.py): the lock's record, refusal naming the holder (another process
holding the flock, or a live record on a file system whose flock does not exclude), takeover of a dead run's lock,
the heartbeat, and prepare() leaving a held folder untouched. Two real training runs racing for one folder:
tests/integration/test_run_folder.py."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from finetune.run import folder_lock
from finetune.config import ConfigError
from tests.helpers import ROOT, TINY_RECIPE

ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")
HOLDER = "import sys; from finetune.run import folder_lock; folder_lock.acquire(sys.argv[1]); print('held', flush=True); sys.stdin.read()"


@pytest.fixture
def holder():
    """Start another process that takes the lock of a folder and keeps it until its stdin closes (or it is killed)."""
    procs = []

    def start(folder) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _record(folder) -> dict:
    return json.loads((folder / folder_lock.LOCK_FILE).read_text())


def _write_lock(folder, **record) -> None:
    folder.mkdir(exist_ok=True)
    (folder / folder_lock.LOCK_FILE).write_text(json.dumps(record))


def _digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_lock_names_its_holder_and_is_removed_with_the_folder_it_created(tmp_path):
    folder = tmp_path / "run"
    lock = folder_lock.acquire(str(folder))
    try:
        record = _record(folder)
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
        assert time.strptime(record["started"], "%Y-%m-%d %H:%M:%S %z")
        assert folder_lock.acquire(str(folder)) is lock  # runs one after another in one process share it
    finally:
        lock.release()
    assert not folder.exists()  # created by this lock and left empty: removed
    kept = tmp_path / "kept"
    kept.mkdir()
    folder_lock.acquire(str(kept)).release()
    assert kept.is_dir() and os.listdir(kept) == []  # it existed before: kept


def test_second_run_is_refused_then_takes_over_once_the_holder_is_killed(tmp_path, holder, capsys):
    folder = tmp_path / "run"
    proc = holder(folder)
    before = (folder / folder_lock.LOCK_FILE).read_bytes()
    with pytest.raises(ConfigError) as e:
        folder_lock.acquire(str(folder))
    message = str(e.value)
    assert f"is in use by another run (host {socket.gethostname()}, PID {proc.pid}, started " in message
    assert "Wait for it to end or stop it, or choose another train.output_dir" in message
    assert (folder / folder_lock.LOCK_FILE).read_bytes() == before  # the holder's record untouched

    proc.kill()
    proc.wait()  # kill -9: no atexit, the file stays; the kernel dropped the flock
    assert (folder / folder_lock.LOCK_FILE).exists()
    lock = folder_lock.acquire(str(folder))
    try:
        assert f"took over the lock of a run that is gone (host {socket.gethostname()}, PID {proc.pid}" in \
            capsys.readouterr().out
        assert _record(folder)["pid"] == os.getpid()
    finally:
        lock.release()


def test_without_flock_a_live_record_refuses_and_a_dead_or_reused_pid_is_taken_over(tmp_path, capsys):
    """NFS without lock support lets every flock succeed: a lock file nobody flocks stands for that case."""
    folder = tmp_path / "run"
    parent = os.getppid()
    _, start = folder_lock._proc_stat(parent)
    live = dict(host=socket.gethostname(), pid=parent, started="earlier", boot_id=folder_lock._boot_id(), proc_start=start)
    _write_lock(folder, **live)
    with pytest.raises(ConfigError, match=f"in use by another run .host {socket.gethostname()}, PID {parent}, "
                                          f"started earlier; lock file {folder / folder_lock.LOCK_FILE}"):
        folder_lock.acquire(str(folder))

    _write_lock(folder, **dict(live, proc_start=start + 1))  # the PID now belongs to another process
    folder_lock.acquire(str(folder)).release()
    assert f"PID {parent} is now another process" in capsys.readouterr().out

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(folder, **dict(live, pid=dead.pid))
    folder_lock.acquire(str(folder)).release()
    assert f"PID {dead.pid} has exited" in capsys.readouterr().out


def test_a_holder_on_another_host_counts_until_its_heartbeat_is_stale(tmp_path, capsys):
    folder = tmp_path / "run"
    _write_lock(folder, host="node7", pid=4242, started="earlier")
    with pytest.raises(ConfigError, match="host node7, PID 4242, started earlier"):
        folder_lock.acquire(str(folder))
    old = time.time() - folder_lock.STALE_AFTER_S - 30
    os.utime(folder / folder_lock.LOCK_FILE, (old, old))
    folder_lock.acquire(str(folder)).release()
    assert "(host node7, PID 4242, started earlier; no heartbeat for" in capsys.readouterr().out


def test_the_holder_keeps_its_heartbeat_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_lock, "HEARTBEAT_S", 0.05)
    folder = tmp_path / "run"
    lock = folder_lock.acquire(str(folder))
    try:
        old = time.time() - 1000
        os.utime(folder / folder_lock.LOCK_FILE, (old, old))
        time.sleep(0.5)
        assert time.time() - os.stat(folder / folder_lock.LOCK_FILE).st_mtime < 5
    finally:
        lock.release()


def test_prepare_into_a_held_folder_is_refused_and_touches_nothing(tmp_path, holder):
    from finetune.train import prepare

    run = tmp_path / "run"
    proc = holder(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    before = _digest(run)
    for extra in ([], ["train.resume=auto"], ["train.overwrite=true"]):
        with pytest.raises(ConfigError, match=f"is in use by another run .host {socket.gethostname()}, PID {proc.pid}"):
            prepare(TINY_RECIPE, ZERO2, [f"train.output_dir={run}", *extra])
        assert _digest(run) == before


def test_the_lock_is_no_content_and_a_failed_start_leaves_no_folder(tmp_path):
    from finetune.train import prepare

    run = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(run, host=socket.gethostname(), pid=dead.pid, started="earlier")  # left by a killed run
    prepare(TINY_RECIPE, ZERO2, [f"train.output_dir={run}"])  # not "not empty"
    folder_lock.release_all()
    assert not (run / folder_lock.LOCK_FILE).exists()

    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match="does not exist"):
        prepare(TINY_RECIPE, ZERO2, [f"train.output_dir={fresh}", f"train.resume={tmp_path / 'nope'}"])
    assert not fresh.exists()


def test_a_file_system_without_flock_falls_back_to_the_record(tmp_path, monkeypatch):
    """NFS without its lock service answers flock with ENOLCK: the run still starts, and a live record still refuses."""
    import errno

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    folder = tmp_path / "run"
    lock = folder_lock.acquire(str(folder))
    try:
        assert _record(folder)["pid"] == os.getpid()
    finally:
        lock.release()
    _, start = folder_lock._proc_stat(os.getppid())
    _write_lock(folder, host=socket.gethostname(), pid=os.getppid(), started="earlier", proc_start=start)
    with pytest.raises(ConfigError, match=f"PID {os.getppid()}, started earlier"):
        folder_lock.acquire(str(folder))


def test_the_flock_of_a_holder_that_has_exited_is_waited_for_then_taken_over(tmp_path, monkeypatch, capsys):
    """After kill -9 the kernel drops a flock when the holder's last thread has closed its files (one in the middle of
    a write finishes it first), while its PID already shows as exited: the next run waits for the flock up to
    RELEASE_WAIT_S and takes over; a flock still held after that is refused, naming the holder."""
    folder = tmp_path / "run"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = dict(host=socket.gethostname(), pid=dead.pid, started="earlier", boot_id=folder_lock._boot_id(), proc_start=1)

    def held_by_the_exited_holder() -> int:
        _write_lock(folder, **record)
        fd = os.open(folder / folder_lock.LOCK_FILE, os.O_RDWR)  # another open file than acquire's: they exclude
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    fd = held_by_the_exited_holder()
    threading.Timer(1.0, os.close, [fd]).start()
    start = time.monotonic()
    folder_lock.acquire(str(folder)).release()
    assert time.monotonic() - start >= 0.9
    assert f"PID {dead.pid} has exited" in capsys.readouterr().out

    monkeypatch.setattr(folder_lock, "RELEASE_WAIT_S", 0.5)
    fd = held_by_the_exited_holder()
    try:
        with pytest.raises(ConfigError, match=f"in use by another run .host {socket.gethostname()}, PID {dead.pid}, "):
            folder_lock.acquire(str(folder))
    finally:
        os.close(fd)
