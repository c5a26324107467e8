"""Writing a checkpoint on every rank, atomically, and reading it back: DeepSpeed state + data position + RNG.

    path = save(engine, "runs/x", step=12, keep_last=2); step = load(engine, find_latest("runs/x"))

Layout: <output_dir>/checkpoints/step_00000012/{engine/..., portable/..., rng_rank<r>.pt, zerotune.json,
manifest.json}. A checkpoint is written under `.tmp-step_...` and renamed into place by rank 0 only after every rank
finished; `zerotune.json`, then `manifest.json` (every file's size and SHA-256, read back: manifest.py) are written
last inside it, so a folder without them (or a `.tmp-` one) is never resumed from. Old checkpoints beyond keep_last
are removed only after the new one is complete. The data position is the step while the rows per step stay the same
(the loader's order depends only on the seed); zerotune.json also records the row, for a resume with other rows per
step. portable/ (portable.py) lets a checkpoint resume on another world size or ZeRO stage. A save that cannot be
written (a full disk) ends on every rank with SaveError, its half-written folder removed, the newest complete
checkpoint untouched.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from argparse import Namespace
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from finetune import dist
from finetune.checkpoint.layout import (ENGINE_TAG, MARKER, UNIVERSAL_TAG, checkpoints_dir, complete_checkpoints, saved_meta,
                                        find_latest, folder_bytes, fsync_dir, human, write_json_atomic)
from finetune.checkpoint import manifest
from finetune.checkpoint import portable

# How torch.save reports a failed write as a RuntimeError: its zip writer loses the errno (mostly ENOSPC) on the
# way; its legacy writer names the error (`write(): fd 3 failed with No space left on device`).
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|basic_ios::clear|iostream error|"
                                 r"file write failed|inline_container\.cc.*unexpected pos|write\(\): fd \d+ failed")
_NAMED_ERROR = re.compile(r"write\(\): fd \d+ failed")
_NO_SPACE = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))
_OK, _DISK_FULL, _WRITE_FAILED = 0, 1, 2  # what each rank reports after its writes of a save


class SaveError(RuntimeError):
    """A checkpoint could not be written; raised on every rank alike, after the half-written folder is removed."""


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
        # The recipe saved with the checkpoint says whether it also gets the layout any world size or stage resumes.
        if meta.get("recipe", {}).get("train", {}).get("portable_checkpoints", True):
            portable.save(engine, tmp, writes.run)
    writes.run(torch.save, _rng_state(), os.path.join(tmp, f"rng_rank{dist.rank()}.pt"))
    _agree(writes, root, tmp, step)
    # Every rank reads back its share of the files (which proves them readable) for manifest.json, written last: a
    # resume or export checks the files against it. A failed read ends the save like a failed write.
    hashed = manifest.gather(writes.run(manifest.hash_share, tmp))
    _agree(writes, root, tmp, step)
    if dist.is_main():
        writes.run(write_json_atomic, os.path.join(tmp, MARKER), {"step": step, "world_size": dist.world_size(), **meta})
        writes.run(manifest.write, tmp, hashed)
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
    fsync_dir(os.path.dirname(final))


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
        written[0] = folder_bytes(tmp)
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
    needs = (f"; a checkpoint needs about {human(folder_bytes(latest))}, as {os.path.basename(latest)} takes" if latest
             else f"; a checkpoint needs more than the {human(written)} it had written" if written else "")
    after = (f"The newest complete checkpoint, {latest}, is intact: free space there (or lower train.keep_last, or copy "
             f"the run folder to a larger disk), then continue with train.resume=auto" if latest else
             "No checkpoint is complete yet: free space there or choose another train.output_dir, then start again")
    return (f"could not save the checkpoint of step {step} in {root}: {what}. There is "
            f"{human(shutil.disk_usage(root).free)} free there{needs}. The half-written {os.path.basename(tmp)} was "
            f"removed. {after}")


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
    """Restore engine, optimizer, scheduler and (same world size) this rank's RNG; returns the step to continue from.

    On the layout it was saved with, from DeepSpeed's own checkpoint; on another number of ranks or ZeRO stage, from
    its portable/ state (or, for an older ZeRO-1/2 one, the universal copy prepare_reshard made)."""
    meta = saved_meta(path)
    route, _ = portable.resume_route(path, {"zero_optimization": {"stage": engine.zero_optimization_stage()}})
    if route == "portable":
        portable.load(engine, path)
    else:
        engine.load_checkpoint(path, tag=UNIVERSAL_TAG if route == "universal" else ENGINE_TAG,
                               load_optimizer_states=True, load_lr_scheduler_states=True)
    rng_file = os.path.join(path, f"rng_rank{dist.rank()}.pt")
    if meta["world_size"] == dist.world_size() and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return int(meta["step"])
