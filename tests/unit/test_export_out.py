"""`zerotune export --out DIR` never loses what DIR holds: a folder with files in it is refused (naming it, and
--overwrite or another folder as the ways on); with --overwrite its files stay until the new export is complete, and a
failed export leaves them as they were; a file, or a folder holding what the export reads, is refused even then.

The run exported here is a finished run's final export (export/, copied as it is), so no model is built; the same
checks guard a checkpoint's export (tests/integration/test_export_run.py)."""

import os
import shutil

import pytest

from finetune import cli
from finetune.export import weights


def _tree(folder) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


@pytest.fixture
def run(tmp_path):
    """A finished run whose export/ is what there is to export (train.save_every=0)."""
    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text('{"model_type": "mistral"}')
    (export / "model.safetensors").write_bytes(os.urandom(4096))
    return tmp_path / "run"


@pytest.fixture
def kept(tmp_path):
    """An --out folder that already holds someone's files, a subfolder among them."""
    out = tmp_path / "kept"
    (out / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.bin", "c.json", "sub/d.txt"):
        (out / name).write_bytes(os.urandom(64))
    return out


def export(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(["export", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_folder_that_holds_files_is_refused_and_kept(run, kept, capsys):
    before = _tree(kept)
    code, stdout, err = export(capsys, str(run), "--out", str(kept))
    assert code == 2 and stdout == ""
    assert err == (f"zerotune: error: --out {str(kept)!r} is not empty (it holds a.txt, b.bin, c.json and 1 more): "
                   f"choose another folder, or pass --overwrite to replace it (its files stay until the new export is "
                   f"complete)\n")
    assert _tree(kept) == before and sorted(os.listdir(kept.parent)) == ["kept", "run"]  # nothing written beside it


def test_an_empty_or_new_folder_is_written(run, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        code, stdout, err = export(capsys, str(run), "--out", str(out))
        assert (code, err) == (0, "") and stdout == f"exported {out} from {run / 'export'}\n"
        assert _tree(out) == _tree(run / "export")


def test_overwrite_replaces_the_folder_with_the_export(run, kept, capsys):
    code, stdout, err = export(capsys, str(run), "--out", str(kept), "--overwrite")
    assert (code, err) == (0, "") and stdout == f"exported {kept} from {run / 'export'}\n"
    assert _tree(kept) == _tree(run / "export")
    assert sorted(os.listdir(kept.parent)) == ["kept", "run"]  # no .tmp or .old folder left behind


def test_a_failed_overwrite_leaves_the_folder_as_it_was(run, kept, capsys, monkeypatch):
    before = _tree(kept)

    copytree = shutil.copytree

    def copy_then_fail(src, dst):  # the disk fills up once the copy is written, before it is put in place
        copytree(src, dst)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weights.shutil, "copytree", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        cli.main(["export", str(run), "--out", str(kept), "--overwrite"])
    assert _tree(kept) == before
    assert sorted(os.listdir(kept.parent)) == ["kept", "run"]  # the half-written copy removed


def test_a_failed_rename_into_place_puts_the_old_folder_back(tmp_path, kept, monkeypatch):
    before = _tree(kept)
    new = tmp_path / "kept.tmp"
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"new")
    real_rename = os.rename

    def rename(src, dst):
        if str(src) == str(new):
            raise OSError(5, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(weights.os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        weights._put_in_place(str(new), str(kept))
    assert _tree(kept) == before and not [n for n in os.listdir(tmp_path) if ".old-" in n]


def test_what_the_export_reads_or_a_file_is_refused_even_with_overwrite(run, tmp_path, capsys):
    before = _tree(tmp_path)
    for out, what in ((run, run), (tmp_path, run), (run / "export", run / "export")):
        code, _, err = export(capsys, str(run), "--out", str(out), "--overwrite")
        assert code == 2 and err == (f"zerotune: error: --out {str(out)!r} holds {str(what)!r}, which this export "
                                     f"reads; writing there would replace it: choose another folder\n")
    (tmp_path / "notes.txt").write_text("mine")
    code, _, err = export(capsys, str(run), "--out", str(tmp_path / "notes.txt"), "--overwrite")
    assert code == 2 and "--out" in err and "is a file, not a folder: choose a folder" in err
    assert _tree(tmp_path) == {**before, "notes.txt": b"mine"}
