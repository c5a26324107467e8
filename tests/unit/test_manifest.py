"""A checkpoint's manifest.json without an engine: written from every rank's share, read back; a truncated, changed or
missing file is named; a checkpoint of an older zerotune (no manifest) is accepted unverified; train.resume=auto skips
a damaged checkpoint for the one before, an explicit one is refused, and `zerotune export` refuses it. The save and
resume with real engines on 2 ranks: tests/integration/test_verified_resume.py."""

import hashlib
import json
import os

import pytest

from finetune import checkpoint
from finetune.checkpoint import manifest
from finetune.config import ConfigError

FILES = {"engine/mp_rank_00_model_states.pt": b"m" * 3000, "engine/zero_pp_rank_0_optim_states.pt": b"a" * 5000,
         "engine/zero_pp_rank_1_optim_states.pt": b"b" * 4900, "engine/zero_to_fp32.py": b"print()\n",
         "rng_rank0.pt": b"r0" * 40, "rng_rank1.pt": b"r1" * 40}


def _checkpoint(run, step: int, with_manifest: bool = True, world: int = 2) -> str:
    """A complete checkpoint folder as store.save leaves it: files, marker, then the manifest from `world` shares."""
    path = os.path.join(run, "checkpoints", f"step_{step:08d}")
    for rel, data in FILES.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    entries = {}
    for rank in range(world):
        entries.update(manifest.hash_share(path, rank, world))
    with open(os.path.join(path, checkpoint.MARKER), "w") as f:
        json.dump({"step": step, "world_size": world}, f)
    if with_manifest:
        manifest.write(path, entries)
    return path


def test_manifest_round_trip_lists_every_file_with_its_size_and_sha256(tmp_path):
    path = _checkpoint(str(tmp_path), 2)
    written = json.loads(open(os.path.join(path, manifest.MANIFEST)).read())
    marker = open(os.path.join(path, checkpoint.MARKER), "rb").read()
    want = {rel: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for rel, data in {**FILES, checkpoint.MARKER: marker}.items()}
    assert written == {"algorithm": "sha256", "files": want}
    assert manifest.verify(path) == []
    assert [manifest.verify(path, rank, 3) for rank in range(3)] == [[], [], []]


def test_shares_cover_every_file_once_balanced_by_size():
    files = [("a", 100), ("b", 90), ("c", 60), ("d", 40), ("e", 10)]
    got = manifest.shares(files, 2)
    assert got == [["a", "d", "e"], ["b", "c"]]  # 150 and 150 bytes
    assert manifest.shares(list(reversed(files)), 2) == got  # the same on every rank, whatever the listing order
    assert sorted(n for share in manifest.shares(files, 4) for n in share) == ["a", "b", "c", "d", "e"]
    assert manifest.shares(files, 8)[5:] == [[], [], []]  # more ranks than files


def _damage(path: str) -> None:
    """Three ways a checkpoint goes bad after its save: a copy cut short, a changed byte, a removed file."""
    with open(os.path.join(path, "engine/zero_pp_rank_1_optim_states.pt"), "r+b") as f:
        f.truncate(1000)
    with open(os.path.join(path, "engine/mp_rank_00_model_states.pt"), "r+b") as f:
        f.seek(1234)
        f.write(b"x")
    os.remove(os.path.join(path, "rng_rank1.pt"))


def test_truncated_flipped_and_missing_files_are_each_named(tmp_path):
    path = _checkpoint(str(tmp_path), 2)
    _damage(path)
    want = ["engine/mp_rank_00_model_states.pt: checksum differs from the save (its bytes changed since)",
            "engine/zero_pp_rank_1_optim_states.pt: truncated (1,000 of 4,900 bytes)",
            "rng_rank1.pt: missing"]
    assert sorted(manifest.verify(path)) == want
    shared = [p for rank in range(2) for p in manifest.verify(path, rank, 2)]  # each rank checks its share
    assert sorted(shared) == want
    assert manifest.verify_on_ranks(path) == want  # one process: its share is all of them
    with open(os.path.join(path, "rng_rank0.pt"), "ab") as f:
        f.write(b"more")
    assert "rng_rank0.pt: longer than saved (84 bytes, saved 80)" in manifest.verify(path)


def test_a_checkpoint_without_manifest_is_accepted_unverified(tmp_path, capsys):
    path = _checkpoint(str(tmp_path), 2, with_manifest=False)
    assert manifest.verify(path) == [] and not manifest.has_manifest(path)
    assert checkpoint.verified_resume("auto", path, str(tmp_path)) == path
    assert capsys.readouterr().out == f"zerotune: note: {path} has no manifest.json (saved by an older zerotune): its files are not verified\n"


def test_resume_auto_skips_a_damaged_checkpoint_for_the_one_before(tmp_path, capsys):
    run = str(tmp_path)
    older, newest = _checkpoint(run, 2), _checkpoint(run, 4)
    with open(os.path.join(newest, "engine/zero_pp_rank_0_optim_states.pt"), "r+b") as f:
        f.truncate(10)
    contents = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert checkpoint.verified_resume("auto", newest, run) == older
    assert capsys.readouterr().err == (
        f"zerotune: warning: skipping checkpoint {newest}: it does not match its manifest.json: "
        f"engine/zero_pp_rank_0_optim_states.pt: truncated (10 of 5,000 bytes); checking the one before\n")
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == contents  # nothing deleted
    assert checkpoint.verified_resume(run, newest, "elsewhere") == older  # a run folder as train.resume: the same


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    run = str(tmp_path)
    _checkpoint(run, 2)
    newest = _checkpoint(run, 4)
    os.remove(os.path.join(newest, "rng_rank0.pt"))
    with pytest.raises(ConfigError, match=r"train.resume='.*step_00000004': the checkpoint does not match its "
                                          r"manifest.json, its files changed after the save: rng_rank0.pt: missing\. "
                                          r"Restore the files named from a copy, or resume another checkpoint"):
        checkpoint.verified_resume(newest, newest, run)


def test_no_checkpoint_verifying_names_each_bad_file(tmp_path, capsys):
    run = str(tmp_path)
    older, newest = _checkpoint(run, 2), _checkpoint(run, 4)
    os.remove(os.path.join(older, "rng_rank1.pt"))
    _damage(newest)
    with pytest.raises(ConfigError) as refused:
        checkpoint.verified_resume("auto", newest, run)
    message = str(refused.value)
    assert message.startswith(f"no complete checkpoint in {os.path.dirname(newest)} matches its manifest.json: "
                              f"step_00000004: engine/mp_rank_00_model_states.pt: checksum differs"), message
    assert "step_00000002: rng_rank1.pt: missing. Restore the files named from a copy, or move these checkpoints" in message
    assert "no older complete checkpoint is left" in capsys.readouterr().err


def test_export_refuses_a_damaged_checkpoint_naming_the_file(tmp_path, capsys):
    from finetune.export.weights import main as export_main

    newest = _checkpoint(str(tmp_path), 4)
    _checkpoint(str(tmp_path), 2)
    with open(os.path.join(newest, "engine/zero_pp_rank_1_optim_states.pt"), "r+b") as f:
        f.truncate(7)
    assert export_main([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"zerotune: error: {newest!r} does not match its manifest.json, its files changed after the save: "
                   f"engine/zero_pp_rank_1_optim_states.pt: truncated (7 of 4,900 bytes). Restore the files named from "
                   f"a copy, or export another checkpoint with --step N (other complete checkpoints: 2)\n")
    assert not os.path.exists(tmp_path / "out")
