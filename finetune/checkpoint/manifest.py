"""A checkpoint's manifest: the size and SHA-256 of every file, read back at save, checked before a resume or export.

    entries = gather(hash_share(tmp)); write(tmp, entries)     # at save: every rank reads back its share (store.save)
    problems = verify(path)                                    # [] or one line per bad file: "engine/x.pt: truncated ..."

`manifest.json` is written last, after `zerotune.json`, inside the `.tmp-` folder that the save then renames: a
complete checkpoint either has a manifest covering every file it was saved with, or was saved by an older zerotune
(then it is accepted unverified, with a note). Reading every file back at save proves it readable and catches a
short write the writer did not report; checking at resume catches what happened to the files since (a copy cut
short, a disk error, a file removed). The files are shared out among the ranks by size, so each rank reads a part.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

from finetune import dist
from finetune.checkpoint.layout import complete_checkpoints, fsync_dir, write_json_atomic
from finetune.config import ConfigError

MANIFEST = "manifest.json"
ALGORITHM = "sha256"
_CHUNK = 1 << 23  # read size: large enough that the hashing, not the calls, takes the time
_SHOWN = 5  # bad files named per checkpoint in a message; the rest are counted


def _listing(folder: str) -> list[tuple[str, int]]:
    """(path relative to folder, with /, size) of every file in it but the manifest, sorted."""
    found = []
    for here, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            rel = os.path.relpath(os.path.join(here, name), folder).replace(os.sep, "/")
            if rel not in (MANIFEST, f"{MANIFEST}.tmp"):
                found.append((rel, os.path.getsize(os.path.join(here, name))))
    return sorted(found)


def shares(files: list[tuple[str, int]], world: int) -> list[list[str]]:
    """The files (name, size) dealt out to `world` ranks, largest first to the least loaded rank: the same answer on
    every rank for the same files, and each rank reads about as many bytes as the others."""
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        r = min(range(world), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += size
    return out


def hash_file(path: str) -> dict[str, Any]:
    """{"bytes": size, "sha256": hex digest} of a file, read in chunks."""
    digest, size = hashlib.new(ALGORITHM), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
            size += n
    return {"bytes": size, ALGORITHM: digest.hexdigest()}


def hash_share(folder: str, rank: int | None = None, world: int | None = None) -> dict[str, dict[str, Any]]:
    """This rank's share of the files in `folder`, read back: {relative path: {"bytes", "sha256"}}."""
    rank = dist.rank() if rank is None else rank
    world = dist.world_size() if world is None else world
    mine = shares(_listing(folder), world)[rank]
    return {rel: hash_file(os.path.join(folder, rel)) for rel in mine}


def gather(entries: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Every rank's entries merged, on every rank (one collective; every rank must call it). None: a rank whose
    reading failed (its error goes through the save's own agreement)."""
    merged: dict[str, dict[str, Any]] = {}
    for part in dist.all_gather_object(entries or {}):
        merged.update(part)
    return merged


def write(folder: str, entries: dict[str, dict[str, Any]]) -> None:
    """Rank 0, last in a save: hash what no rank did (the marker written after the gather, a file another rank's
    listing of a shared file system did not show yet) and write manifest.json atomically and durably."""
    files = dict(entries)
    for rel, _ in _listing(folder):
        if rel not in files:
            files[rel] = hash_file(os.path.join(folder, rel))
    write_json_atomic(os.path.join(folder, MANIFEST),
                      {"algorithm": ALGORITHM, "files": {rel: files[rel] for rel in sorted(files)}})
    fsync_dir(folder)


def has_manifest(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def verify(path: str, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with this rank's share of the files the manifest of checkpoint `path` lists, one line per file
    ("engine/x.pt: truncated (...)"); [] when they match. A checkpoint without a manifest gives [] (has_manifest
    tells it apart). Files added after the save (a universal copy made for another world size) are not checked."""
    if not has_manifest(path):
        return []
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            listed = json.load(f)["files"]
        sizes = [(rel, int(entry["bytes"])) for rel, entry in listed.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST}: unreadable ({e})"] if rank == 0 else []
    return [p for rel in shares(sizes, world)[rank] if (p := _check(path, rel, listed[rel]))]


def _check(path: str, rel: str, entry: dict[str, Any]) -> str | None:
    full = os.path.join(path, *rel.split("/"))
    want = int(entry["bytes"])
    try:
        size = os.path.getsize(full)
        if size < want:
            return f"{rel}: truncated ({size:,} of {want:,} bytes)"
        if size > want:
            return f"{rel}: longer than saved ({size:,} bytes, saved {want:,})"
        got = hash_file(full)[ALGORITHM]
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as e:
        return f"{rel}: unreadable ({e.strerror or e})"
    if got != entry[ALGORITHM]:
        return f"{rel}: checksum differs from the save (its bytes changed since)"
    return None


def verify_on_ranks(path: str) -> list[str]:
    """verify() over every rank's share; every rank gets the whole list (one collective; every rank must call it)."""
    parts = dist.all_gather_object(verify(path, dist.rank(), dist.world_size()))
    return sorted(p for part in parts for p in part)


def summary(problems: list[str]) -> str:
    shown = "; ".join(problems[:_SHOWN])
    return shown + (f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else "")


def unverified_note(path: str) -> str:
    return f"zerotune: note: {path} has no {MANIFEST} (saved by an older zerotune): its files are not verified"


def verified_resume(resume: str | None, chosen: str | None, output_dir: str) -> str | None:
    """The checkpoint to resume after checking its files on all ranks together (every rank must call it, after the
    process group started; every rank gets the same answer). `chosen` is resolve_resume's pick.

    train.resume=auto (or a run folder): a checkpoint whose files do not match its manifest is skipped with a warning
    naming the bad files, and the next older complete one is checked; nothing is deleted. None of them verifying is a
    ConfigError naming each bad file. A train.resume naming a checkpoint folder that does not verify is a ConfigError
    naming the bad files: another checkpoint is never taken in its place."""
    if chosen is None:
        return None
    explicit = resume != "auto" and os.path.normpath(resume or "") == os.path.normpath(chosen)
    candidates = [chosen] if explicit else _this_and_older(chosen, output_dir if resume == "auto" else str(resume))
    bad: list[tuple[str, list[str]]] = []
    for path in candidates:
        problems = verify_on_ranks(path)
        if not problems:
            if not has_manifest(path) and dist.is_main():
                print(unverified_note(path), flush=True)
            return path
        bad.append((path, problems))
        if dist.is_main() and not explicit:
            after = "checking the one before" if path != candidates[-1] else "no older complete checkpoint is left"
            print(f"zerotune: warning: skipping checkpoint {path}: it does not match its {MANIFEST}: "
                  f"{summary(problems)}; {after}", file=sys.stderr, flush=True)
    if explicit:
        raise ConfigError(f"train.resume={resume!r}: the checkpoint does not match its {MANIFEST}, its files changed "
                          f"after the save: {summary(bad[0][1])}. Restore the files named from a copy, or resume "
                          f"another checkpoint (train.resume=auto takes the newest one whose files match)")
    listed = "; ".join(f"{os.path.basename(p)}: {summary(problems)}" for p, problems in bad)
    raise ConfigError(f"no complete checkpoint in {os.path.dirname(chosen)} matches its {MANIFEST}: {listed}. Restore "
                      f"the files named from a copy, or move these checkpoints out of that folder to train from the "
                      f"start (train.resume=auto starts fresh where no complete checkpoint is left)")


def _this_and_older(chosen: str, run_dir: str) -> list[str]:
    """`chosen`, then the complete checkpoints of its run saved before it, newest first."""
    older = [p for _, p in reversed(complete_checkpoints(run_dir))]
    norm = [os.path.normpath(p) for p in older]
    start = norm.index(os.path.normpath(chosen)) if os.path.normpath(chosen) in norm else None
    return [chosen] if start is None else older[start:]
