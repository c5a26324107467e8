"""Checkpoints that survive kill -9: DeepSpeed state + data position + every rank's RNG, made visible atomically.

    path = save(engine, "runs/x", step=12, keep_last=2); step = load(engine, find_latest("runs/x"))

Layout: <output_dir>/checkpoints/step_00000012/{engine/..., rng_rank<r>.pt, zerotune.json}. A checkpoint is written
under `.tmp-step_...` and renamed into place by rank 0 only after every rank finished; `zerotune.json` is written
last inside it, so a folder without it (or a `.tmp-` one) is never resumed from. Old checkpoints beyond keep_last
are removed only after the new one is complete. The data position is the step: the loader's order depends only
on the seed and the step. A save that cannot be written (a full disk) ends on every rank with SaveError, its
half-written folder removed, the newest complete checkpoint untouched.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import socket
from argparse import Namespace
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from finetune import dist
from finetune.config import ConfigError, TrainConfig
from finetune.metrics import matmul_params

ENGINE_TAG = "engine"
UNIVERSAL_TAG = "universal"  # the same state converted for another world size (DeepSpeed universal checkpoint)
MARKER = "zerotune.json"
WRITE_PROBE = ".write-test-"
STEP_DIR = re.compile(r"^step_(\d{8})$")
# How torch.save reports a failed write as a RuntimeError: its zip writer loses the errno (mostly ENOSPC) on the
# way; its legacy writer names the error (`write(): fd 3 failed with No space left on device`).
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|basic_ios::clear|iostream error|"
                                 r"file write failed|inline_container\.cc.*unexpected pos|write\(\): fd \d+ failed")
_NAMED_ERROR = re.compile(r"write\(\): fd \d+ failed")
_NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_OK, _DISK_FULL, _WRITE_FAILED = 0, 1, 2  # what each rank reports after its writes of a save


class SaveError(RuntimeError):
    """A checkpoint could not be written; raised on every rank alike, after the half-written folder is removed."""


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, MARKER)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def find_latest(output_dir: str) -> str | None:
    found = complete_checkpoints(output_dir)
    return found[-1][1] if found else None


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """`auto` = newest complete checkpoint in output_dir (None if there is none yet); else a checkpoint or run folder."""
    if not resume:
        return None
    if resume == "auto":
        return find_latest(output_dir)
    if not os.path.isdir(resume):
        raise ConfigError(f"train.resume={resume!r} does not exist: give a run folder, a checkpoints/step_* folder, or auto")
    if STEP_DIR.match(os.path.basename(os.path.normpath(resume))):
        if not os.path.isfile(os.path.join(resume, MARKER)):
            raise ConfigError(f"train.resume={resume!r} is not a complete zerotune checkpoint (no {MARKER}: its save "
                              f"never finished); use train.resume=auto to take the newest complete one")
        return resume
    latest = find_latest(resume)
    if latest is None:
        raise ConfigError(f"train.resume={resume!r}: no complete checkpoint there (looked for checkpoints/step_*/{MARKER})")
    return latest


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, output_dir: str, step: int, keep_last: int, meta: dict[str, Any]) -> str:
    """Write checkpoint `step` on every rank; returns its final path. All ranks must call this.

    Raises SaveError on every rank when any rank could not write its part (the half-written folder is removed)."""
    root = checkpoints_dir(output_dir)
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    writes = _Writes()
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        writes.run(os.makedirs, tmp)
    _agree(writes, root, tmp, step)
    # DeepSpeed's save runs collectives between its writes (the tag check, ZeRO-3's gathers, its closing barrier): a
    # write error raised in there on one rank would leave the others waiting in the next one. Its writes are held
    # instead, every rank goes through the whole sequence, and the ranks agree on the outcome afterwards.
    with _held_write_errors(engine, writes):
        engine.save_checkpoint(tmp, tag=ENGINE_TAG, client_state={"step": step}, save_latest=False)
    writes.run(torch.save, _rng_state(), os.path.join(tmp, f"rng_rank{dist.rank()}.pt"))
    _agree(writes, root, tmp, step)
    if dist.is_main():
        writes.run(_write_json_atomic, os.path.join(tmp, MARKER), {"step": step, "world_size": dist.world_size(), **meta})
        writes.run(_publish, tmp, final)
        if writes.code == _OK:
            for old_step, old_path in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
                shutil.rmtree(old_path, ignore_errors=True)
    _agree(writes, root, tmp, step)
    return final


def _publish(tmp: str, final: str) -> None:
    """Rename the finished checkpoint into place, durably."""
    if os.path.exists(final):  # re-saving the same step (a resumed run) replaces it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))


class _Writes:
    """The first write error of this rank in a save; later writes of the same save are skipped (they would fail
    too, and each costs the time of a full write)."""

    def __init__(self):
        self.code, self.error = _OK, None

    def run(self, fn, *args, **kwargs):
        if self.code != _OK:
            return None
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            self.code = _DISK_FULL if e.errno in (errno.ENOSPC, errno.EDQUOT) else _WRITE_FAILED
            self.error = str(e)
        except RuntimeError as e:
            text = str(e)
            if not _TORCH_WRITE_FAILED.search(text):
                raise
            named_other = _NAMED_ERROR.search(text) and not any(n in text for n in _NO_SPACE)
            self.code, self.error = _WRITE_FAILED if named_other else _DISK_FULL, text
        # Only the text is kept: the exception's traceback would keep the frames of the failed write, and with them
        # its open file, whose space a removed file keeps until it is closed.
        return None


@contextmanager
def _held_write_errors(engine, writes: _Writes):
    """Within it, DeepSpeed's checkpoint writes of `engine` (its checkpoint engine's save, the recovery scripts it
    copies) go through `writes`: an error is recorded, not raised."""
    writer = getattr(engine, "checkpoint_engine", None)
    if writer is not None:
        save = writer.save
        writer.save = lambda *args, **kwargs: writes.run(save, *args, **kwargs)
    if hasattr(engine, "_copy_recovery_script"):
        copy = engine._copy_recovery_script
        engine._copy_recovery_script = lambda *args, **kwargs: writes.run(copy, *args, **kwargs)
    try:
        yield
    finally:
        if writer is not None:
            del writer.save
        if "_copy_recovery_script" in vars(engine):
            del engine._copy_recovery_script


def _agree(writes: _Writes, root: str, tmp: str, step: int) -> None:
    """Every rank learns every rank's outcome (one collective, in place of a barrier). If any rank failed, rank 0
    removes the half-written folder and every rank raises the same SaveError."""
    codes = torch.zeros(dist.world_size(), dtype=torch.float64)
    codes[dist.rank()] = writes.code
    codes = dist.all_reduce_sum(codes).tolist()
    if not any(codes):
        return
    written = torch.zeros(1, dtype=torch.float64)
    if dist.is_main():
        written[0] = _folder_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
    written = int(dist.all_reduce_sum(written)[0])  # also a barrier: the folder is gone when any rank goes on
    failed = [r for r, c in enumerate(codes) if c != _OK]
    raise SaveError(_save_failed_message(root, tmp, step, failed, _DISK_FULL in codes, written, writes.error))


def _save_failed_message(root: str, tmp: str, step: int, failed: list[int], disk_full: bool, written: int,
                         own_error: str | None) -> str:
    ranks = f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}"
    if disk_full:
        what = f"the disk is full (no space left on the device, seen by {ranks})"
    else:
        what = f"a write error on {ranks}" + (f" ({own_error})" if own_error is not None else ": see its log")
    latest = find_latest(os.path.dirname(root))
    needs = (f"; a checkpoint needs about {_human(_folder_bytes(latest))}, as {os.path.basename(latest)} takes" if latest
             else f"; a checkpoint needs more than the {_human(written)} it had written" if written else "")
    after = (f"The newest complete checkpoint, {latest}, is intact: free space there (or lower train.keep_last, or copy "
             f"the run folder to a larger disk), then continue with train.resume=auto" if latest else
             "No checkpoint is complete yet: free space there or choose another train.output_dir, then start again")
    return (f"could not save the checkpoint of step {step} in {root}: {what}. There is "
            f"{_human(shutil.disk_usage(root).free)} free there{needs}. The half-written {os.path.basename(tmp)} was "
            f"removed. {after}")


def _folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(folder, f))
            except OSError:  # removed meanwhile
                pass
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def saved_world_size(path: str) -> int:
    with open(os.path.join(path, MARKER)) as f:
        return int(json.load(f)["world_size"])


def saved_step(path: str) -> int:
    """The step a complete checkpoint was saved at."""
    with open(os.path.join(path, MARKER)) as f:
        return int(json.load(f)["step"])


def prepare_reshard(path: str) -> None:
    """Convert a checkpoint saved on another number of ranks to DeepSpeed's universal format (once, atomically).

    The engine must then be created with {"checkpoint": {"load_universal": true}}; `load` picks the universal copy.
    """
    # Lazy: only a resharded resume needs deepspeed here; prepare's checks of a checkpoint run without loading it.
    from deepspeed.checkpoint import ds_to_universal

    final, tmp = os.path.join(path, UNIVERSAL_TAG), os.path.join(path, f".tmp-{UNIVERSAL_TAG}")
    if dist.is_main() and not os.path.isdir(final):
        shutil.rmtree(tmp, ignore_errors=True)
        ds_to_universal.main(Namespace(input_folder=os.path.join(path, ENGINE_TAG), output_folder=tmp,
                                       num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                                       strict=True, inject_missing_state=True))
        os.rename(tmp, final)
    dist.barrier()


def load(engine, path: str) -> int:
    """Restore engine, optimizer, scheduler and (same world size) this rank's RNG; returns the step to continue from."""
    with open(os.path.join(path, MARKER)) as f:
        meta = json.load(f)
    resharded = meta["world_size"] != dist.world_size()
    engine.load_checkpoint(path, tag=UNIVERSAL_TAG if resharded else ENGINE_TAG, load_optimizer_states=True,
                           load_lr_scheduler_states=True)
    rng_file = os.path.join(path, f"rng_rank{dist.rank()}.pt")
    if meta["world_size"] == dist.world_size() and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(meta["step"])


def estimate_checkpoint_bytes(model_config: dict[str, Any], lora_trainable_fraction: float | None) -> int:
    """Bytes of one checkpoint: 16-bit weights of the whole model + fp32 master, Adam moments of what is trained."""
    cfg = SimpleNamespace(**model_config)
    total = matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    trained = total if lora_trainable_fraction is None else int(total * lora_trainable_fraction)
    return 2 * total + 12 * trained


def planned_saves(train: TrainConfig, start_step: int) -> int:
    """How many checkpoints a run from start_step saves: every save_every steps, and its last step."""
    if train.save_every <= 0:
        return 0
    end = min(train.max_steps, train.stop_at) if train.stop_at else train.max_steps
    if end <= start_step:
        return 0
    return end // train.save_every - start_step // train.save_every + (1 if end % train.save_every else 0)


def new_checkpoints_at_once(keep_last: int, saves: int, existing: int) -> int:
    """The most checkpoints' worth of new disk space a run takes at one time: during a save the keep_last newest
    complete checkpoints (those already there among them) sit beside the one being written, and the older ones
    go only once it is complete; keep_last=0 keeps every checkpoint, so all `saves` of the run stay."""
    if saves <= 0:
        return 0
    if keep_last <= 0:
        return saves
    # Save k (from 1) starts with min(existing + k - 1, keep_last) complete ones present (the first with all
    # `existing`); the most beyond what `existing` already take is at the last save, and never less than the new one.
    return max(1, min(saves, keep_last + 1 - existing))


def checkpoints_to_fit(train: TrainConfig, resume_from: str | None) -> tuple[int, str]:
    """How many checkpoints' worth of free space train.output_dir needs before the run starts, and why."""
    existing = len(complete_checkpoints(train.output_dir))
    saves = planned_saves(train, saved_step(resume_from) if resume_from else 0)
    count = new_checkpoints_at_once(train.keep_last, saves, existing)
    if train.keep_last <= 0:
        why = f"train.keep_last=0 keeps all {saves} checkpoints this run saves"
    else:
        why = (f"train.keep_last={train.keep_last} keeps that many complete checkpoints beside the one being written"
               + (f", {existing} of them already there" if existing else ""))
    return count, why


def check_output_dir(path: str, needed_bytes: int, count: int = 1, why: str = "") -> None:
    """Fail before the first step if the run folder is not writable or cannot hold `count` checkpoints of
    `needed_bytes` each (`why` says where the count comes from)."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f"{WRITE_PROBE}{socket.gethostname()}-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"train.output_dir {path!r} is not writable ({e.strerror}): choose another folder or fix its permissions") from None
    free = shutil.disk_usage(path).free
    if needed_bytes * count <= free:
        return
    if count <= 1:
        raise ConfigError(
            f"train.output_dir {path!r} has {_human(free)} free but one checkpoint needs about "
            f"{_human(needed_bytes)}: free space there, choose another folder, or set train.save_every=0")
    because = f" ({why})" if why else ""
    raise ConfigError(
        f"train.output_dir {path!r} has {_human(free)} free but {count} checkpoints need about "
        f"{_human(needed_bytes * count)}, {_human(needed_bytes)} each{because}: free space there, choose another "
        f"folder, lower train.keep_last, or set train.save_every=0")


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
