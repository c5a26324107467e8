"""Checkpoints without an engine: a half-written checkpoint is never resumed from, and an unwritable or full output
folder fails before the first step. The engine tests (exact resume, kill -9, export) are
tests/integration/test_checkpoint.py."""

import os

import pytest

from finetune import checkpoint
from finetune.config import ConfigError
from tests.helpers import ROOT, TINY_RECIPE



def test_half_written_checkpoints_are_never_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000006").mkdir(parents=True)
    (root / "step_00000006" / checkpoint.MARKER).write_text('{"step": 6, "world_size": 1}')
    (root / ".tmp-step_00000009").mkdir()  # killed in the middle of a save
    (root / "step_00000012").mkdir()  # no marker: never completed
    assert checkpoint.find_latest(str(tmp_path)) == str(root / "step_00000006")
    assert checkpoint.resolve_resume("auto", str(tmp_path)) == str(root / "step_00000006")
    with pytest.raises(ConfigError, match="not a complete zerotune checkpoint"):
        checkpoint.resolve_resume(str(root / "step_00000012"), str(tmp_path))


def test_unwritable_output_dir_fails_before_training(tmp_path):
    """A path below a regular file cannot be created, even by root (file permissions do not stop root)."""
    from finetune.train import prepare

    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    with pytest.raises(ConfigError, match=f"train.output_dir '{blocker}/run' is not writable"):
        prepare(TINY_RECIPE, os.path.join(ROOT, "ds_configs", "zero2.json"), [f"train.output_dir={blocker}/run"])
    assert blocker.read_text() == "keep me"


def test_full_output_dir_fails_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"has .* GiB free but one checkpoint needs about .* set train.save_every=0"):
        checkpoint.check_output_dir(str(tmp_path), needed_bytes=1 << 62)




