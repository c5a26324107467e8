"""Where checkpoints live and which are complete: <output_dir>/checkpoints/step_<8 digits>/, complete once its
marker file exists (a save writes it, then manifest.json, then renames the folder into place; a `.tmp-` folder never
counts). Whether a complete checkpoint's files are still as saved: manifest.py.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from finetune.config import ConfigError
from finetune.run import folder as run_folder

ENGINE_TAG = "engine"
UNIVERSAL_TAG = "universal"  # the same state converted for another world size (DeepSpeed universal checkpoint)
MARKER = "zerotune.json"
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


def saved_meta(path: str) -> dict[str, Any]:
    """What a complete checkpoint's zerotune.json says: step, world size, data position, recipe, DeepSpeed config."""
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def saved_world_size(path: str) -> int:
    return int(saved_meta(path)["world_size"])


def saved_step(path: str) -> int:
    """The step a complete checkpoint was saved at."""
    return int(saved_meta(path)["step"])


def folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(folder, f))
            except OSError:  # removed meanwhile
                pass
    return total


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


write_json_atomic = run_folder.write_json_file  # every file of a checkpoint that zerotune writes is written whole


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
