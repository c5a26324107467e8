"""Disk space for checkpoints, checked before the first step: how many a run keeps at once, how big each is, and
whether train.output_dir is writable and can hold them.
"""

from __future__ import annotations

import os
import shutil
import socket
from types import SimpleNamespace
from typing import Any

from finetune.checkpoint.layout import complete_checkpoints, human, saved_step
from finetune.config import ConfigError, TrainConfig
from finetune.run.metrics import matmul_params

WRITE_PROBE = ".write-test-"


def estimate_checkpoint_bytes(model_config: dict[str, Any], lora_trainable_fraction: float | None,
                              portable: bool = False) -> int:
    """Bytes of one checkpoint: 16-bit weights of the whole model + fp32 master, Adam moments of what is trained;
    `portable` (train.portable_checkpoints): the master and moments once more, by parameter name (portable/)."""
    cfg = SimpleNamespace(**model_config)
    total = matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size
    trained = total if lora_trainable_fraction is None else int(total * lora_trainable_fraction)
    return 2 * total + (24 if portable else 12) * trained


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
            f"train.output_dir {path!r} has {human(free)} free but one checkpoint needs about "
            f"{human(needed_bytes)}: free space there, choose another folder, or set train.save_every=0")
    because = f" ({why})" if why else ""
    raise ConfigError(
        f"train.output_dir {path!r} has {human(free)} free but {count} checkpoints need about "
        f"{human(needed_bytes * count)}, {human(needed_bytes)} each{because}: free space there, choose another "
        f"folder, lower train.keep_last, or set train.save_every=0")
