"""`zerotune plot` draws 4 panels from runs' metrics.jsonl: one run, several overlaid, a clear error without metrics."""

import json
import struct

import pytest

from finetune.cli import main as zerotune
from finetune.commands.plot import build_figure

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(folder, steps: int, eval_every: int, scale: float):
    """A metrics.jsonl shaped like training's: a record per step (MFU None on CPU), an eval record every eval_every."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "loss": scale * 10 / s, "lr": 1e-3 * s / steps, "grad_norm": 1.0,
                                "tokens": 256, "tokens_per_s": 500.0 + s, "mfu": None, "peak_mem_gib": 0.5 + s / 100,
                                "peak_reserved_gib": 0.6 + s / 100}) + "\n")
            if eval_every and s % eval_every == 0:
                f.write(json.dumps({"step": s, "eval_loss": scale * 11 / s}) + "\n")
    return str(folder)


def png_info(path) -> tuple[int, int, list]:
    """(width, height, the runs listed in the PNG's Source text chunk)."""
    from PIL import Image

    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data[16:24])
    return width, height, json.loads(Image.open(path).text["Source"])


def test_plot_one_run(tmp_path, capsys):
    run = write_run(tmp_path / "tiny", steps=30, eval_every=10, scale=1.0)
    out = tmp_path / "curves.png"
    assert zerotune(["plot", run, "--out", str(out)]) == 0
    width, height, source = png_info(out)
    assert (width, height) == (1200, 750) and out.stat().st_size > 30_000
    assert source == [{"run_dir": run, "label": "tiny", "points": {"loss": 30, "eval_loss": 3, "lr": 30,
                                                                   "tokens_per_s": 30, "peak_mem_gib": 30,
                                                                   "peak_reserved_gib": 30}}]
    assert "tiny (30 steps, 3 evals)" in capsys.readouterr().out


def test_plot_several_runs_overlaid_and_named(tmp_path):
    # Two folders with the same name under different parents: the legend must still tell them apart.
    a = write_run(tmp_path / "a" / "tiny", steps=20, eval_every=5, scale=1.0)
    b = write_run(tmp_path / "b" / "tiny", steps=12, eval_every=0, scale=2.0)
    out = tmp_path / "both.png"
    assert zerotune(["plot", a, b, "--out", str(out)]) == 0
    _, _, source = png_info(out)
    assert [(r["label"], r["points"]["loss"], r["points"].get("eval_loss")) for r in source] == \
        [("a/tiny", 20, 4), ("b/tiny", 12, None)]

    fig, _ = build_figure([a, b])
    loss, lr, throughput, memory = fig.axes
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["a/tiny", "a/tiny eval", "b/tiny"]
    b_loss = loss.lines[2]
    assert list(b_loss.get_xdata()) == list(range(1, 13))
    assert list(b_loss.get_ydata()) == pytest.approx([20 / s for s in range(1, 13)])
    assert [ax.get_title() for ax in fig.axes] == ["loss", "learning rate", "throughput", "peak memory"]
    assert len(lr.lines) == len(throughput.lines) == 2 and len(memory.lines) == 4


def test_plot_refuses_a_run_without_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert zerotune(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no metrics.jsonl: give run folders written by training" in capsys.readouterr().err
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    assert zerotune(["plot", str(tmp_path / "empty"), "--out", str(tmp_path / "x.png")]) == 2
    assert "has no step records yet" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
