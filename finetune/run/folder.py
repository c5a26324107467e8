"""The run folder (`train.output_dir`): the names of the files a run keeps there, their readers and writers, and the one
atomic write that every file a user keeps goes through.

    from finetune.run import folder
    folder.write_json(out, folder.DS_CONFIG, ds)          # out/ds_config.json, whole or not at all
    ds = folder.read_json(run_dir, folder.DS_CONFIG)       # FileNotFoundError / ValueError naming the file

A write goes to a temporary file beside the target, is flushed and fsynced, then renamed over it: a run killed in the
middle of a write leaves the old file or the new one, never half of one (POSIX rename is atomic within a folder).
Checkpoints are folders with their own layout (finetune/checkpoint/layout.py), named there; this module imports
nothing from the package, so the launcher, `compare` and the checkpoint code all read it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import IO, Any

import yaml

RECIPE = "recipe.yaml"
"""The recipe as it ran: every default filled in, every override applied (a resume compares against it)."""
DS_CONFIG = "ds_config.json"
"""The DeepSpeed JSON as the engine got it, its "auto" fields resolved."""
MEMORY_PLAN = "memory_plan.json"
"""The planner's choice, when a GPU memory budget chose the ZeRO stage, offload and recomputation."""
METRICS = "metrics.jsonl"
"""One JSON record a line: every optimizer step, every eval; cut back to a resumed checkpoint's step."""
SAMPLES = "samples.jsonl"
"""The answers to train.sample_prompt at its cadence and at the end."""
SPEEDUPS = "speedups.json"
"""Every speed-up switch, on or off, with the precision and kernels that ran."""
REFERENCE = "reference_logps.pt"
"""A preference run's precomputed reference: the starting model's log-probability of every train and eval sample."""
LOCK = ".zerotune.lock"
"""Held by the run that writes into the folder (finetune/run/folder_lock.py)."""
EXPORT = "export"
"""The folder of the end-of-run export (train.export)."""
STALL = "stall"
"""Where the stall watchdog keeps each rank's heartbeat and its report (finetune/run/watchdog.py)."""
STALL_SUMMARY = "summary.txt"
"""The watchdog's report of a stalled run, inside STALL."""


def path(run_dir: str, name: str) -> str:
    """The path of one of the names above inside a run folder."""
    return os.path.join(run_dir, name)


@contextlib.contextmanager
def atomic_open(target: str, mode: str = "w", durable: bool = True) -> Iterator[IO[Any]]:
    """Open a temporary file beside `target` for writing; on a clean exit it is renamed over `target` (fsynced first
    when `durable`: a file that must survive a power cut, not a heartbeat rewritten every few seconds), on an
    exception removed (the old `target`, if any, stays as it was)."""
    tmp = f"{target}.tmp{os.getpid()}"  # per process: two writers never share a temporary file
    try:
        with open(tmp, mode) as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text(target: str, text: str, durable: bool = True) -> None:
    with atomic_open(target, durable=durable) as f:
        f.write(text)


def write_json(run_dir: str, name: str, data: Any) -> str:
    """Write `data` as indented JSON to run_dir/name, atomically; returns the path."""
    target = path(run_dir, name)
    write_json_file(target, data)
    return target


def write_json_file(target: str, data: Any) -> None:
    with atomic_open(target) as f:
        json.dump(data, f, indent=2)


def write_jsonl(run_dir: str, name: str, records: list[dict[str, Any]]) -> str:
    target = path(run_dir, name)
    with atomic_open(target) as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return target


def write_yaml(run_dir: str, name: str, data: dict[str, Any]) -> str:
    target = path(run_dir, name)
    with atomic_open(target) as f:
        yaml.safe_dump(data, f, sort_keys=False)
    return target


def read_json(run_dir: str, name: str) -> Any:
    """run_dir/name as JSON; a file that is not JSON is a ValueError naming it (a missing one: FileNotFoundError)."""
    return read_json_file(path(run_dir, name))


def read_json_file(file: str) -> Any:
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None


def has(run_dir: str, name: str) -> bool:
    return os.path.exists(path(run_dir, name))


def write_tensors(run_dir: str, name: str, tensors: dict[str, Any]) -> str:
    """torch.save of a dict of tensors to run_dir/name, atomically."""
    import torch  # lazy: the launcher and `compare` read this module without torch

    target = path(run_dir, name)
    with atomic_open(target, "wb") as f:
        torch.save(tensors, f)
    return target


def read_tensors(run_dir: str, name: str) -> dict[str, Any]:
    import torch  # lazy, as above

    return torch.load(path(run_dir, name), map_location="cpu", weights_only=True)
