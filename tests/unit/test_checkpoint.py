"""Checkpoints without an engine: a half-written checkpoint is never resumed from, and an unwritable or full output
folder fails before the first step. The engine tests (exact resume, kill -9, export) are
tests/integration/test_checkpoint.py."""

import os
import shutil

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




def test_space_check_counts_the_checkpoints_that_exist_at_once(tmp_path):
    """During a save, keep_last complete checkpoints sit beside the new one (the oldest goes once it is complete);
    keep_last=0 keeps every checkpoint of the run; those already there take no new space."""
    from finetune.config import TrainConfig

    at_once = checkpoint.new_checkpoints_at_once
    assert [at_once(2, saves, 0) for saves in (0, 1, 2, 3, 10)] == [0, 1, 2, 3, 3]  # keep_last + 1 at most
    assert [at_once(2, 10, existing) for existing in (1, 2, 5)] == [2, 1, 1]  # the old ones are there already
    assert [at_once(0, 7, 0), at_once(0, 7, 3), at_once(1, 7, 0)] == [7, 7, 2]
    train = TrainConfig(output_dir=str(tmp_path), max_steps=10, save_every=4, keep_last=2)
    assert [checkpoint.planned_saves(train, start) for start in (0, 4, 8, 10)] == [3, 2, 1, 0]  # steps 4, 8, 10
    assert checkpoint.planned_saves(TrainConfig(max_steps=10, save_every=4, stop_at=6), 0) == 2  # steps 4, 6
    assert checkpoint.planned_saves(TrainConfig(max_steps=10, save_every=0), 0) == 0

    done = tmp_path / "checkpoints" / "step_00000004"
    done.mkdir(parents=True)
    (done / checkpoint.MARKER).write_text('{"step": 4, "world_size": 1}')
    assert checkpoint.checkpoints_to_fit(train, None) == (
        2, "train.keep_last=2 keeps that many complete checkpoints beside the one being written, 1 of them already there")
    assert checkpoint.checkpoints_to_fit(train, str(done)) == (2, checkpoint.checkpoints_to_fit(train, None)[1])
    keep_all = TrainConfig(output_dir=str(tmp_path), max_steps=10, save_every=4, keep_last=0)
    assert checkpoint.checkpoints_to_fit(keep_all, str(done)) == (2, "train.keep_last=0 keeps all 2 checkpoints this run saves")

    free = shutil.disk_usage(tmp_path).free
    each = int(free * 0.6)  # one fits, two do not
    checkpoint.check_output_dir(str(tmp_path), each, 1)
    with pytest.raises(ConfigError, match=r"has .* free but 2 checkpoints need about .*, .* each \(train.keep_last=2 "
                                          r"keeps .*\): free space there, choose another folder, lower train.keep_last"):
        checkpoint.check_output_dir(str(tmp_path), each, *checkpoint.checkpoints_to_fit(train, None))
