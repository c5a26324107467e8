"""Checkpoints that survive kill -9: DeepSpeed state + data position + every rank's RNG, made visible atomically.

    path = save(engine, "runs/x", step=12, keep_last=2); step = load(engine, find_latest("runs/x"))

Layout: <output_dir>/checkpoints/step_00000012/{engine/..., rng_rank<r>.pt, zerotune.json}. A checkpoint is written
under `.tmp-step_...` and renamed into place by rank 0 only after every rank finished; `zerotune.json` is written
last inside it, so a folder without it (or a `.tmp-` one) is never resumed from. Old checkpoints beyond keep_last
are removed only after the new one is complete. The data position is the step: the loader's order depends only
on the seed and the step.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from finetune import dist
from finetune.config import ConfigError
from finetune.metrics import matmul_params

ENGINE_TAG = "engine"
UNIVERSAL_TAG = "universal"  # the same state converted for another world size (DeepSpeed universal checkpoint)
MARKER = "zerotune.json"
WRITE_PROBE = ".write-test-"
STEP_DIR = re.compile(r"^step_(\d{8})$")


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
    """Write checkpoint `step` on every rank; returns its final path. All ranks must call this."""
    root = checkpoints_dir(output_dir)
    name = f"step_{step:08d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        os.makedirs(tmp)
    dist.barrier()
    engine.save_checkpoint(tmp, tag=ENGINE_TAG, client_state={"step": step}, save_latest=False)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{dist.rank()}.pt"))
    dist.barrier()
    if dist.is_main():
        _write_json_atomic(os.path.join(tmp, MARKER), {"step": step, "world_size": dist.world_size(), **meta})
        if os.path.exists(final):  # re-saving the same step (a resumed run) replaces it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        for old_step, old_path in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old_path, ignore_errors=True)
    dist.barrier()
    return final


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


def check_output_dir(path: str, needed_bytes: int) -> None:
    """Fail before the first step if the run folder is not writable or cannot hold a checkpoint."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f"{WRITE_PROBE}{socket.gethostname()}-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"train.output_dir {path!r} is not writable ({e.strerror}): choose another folder or fix its permissions") from None
    free = shutil.disk_usage(path).free
    if needed_bytes > free:
        raise ConfigError(
            f"train.output_dir {path!r} has {free / 2**30:.1f} GiB free but one checkpoint needs about "
            f"{needed_bytes / 2**30:.1f} GiB: free space there, choose another folder, or set train.save_every=0"
        )


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
