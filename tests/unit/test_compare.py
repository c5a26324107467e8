"""`zerotune compare`'s bookkeeping on made-up runs: a stage beyond the loss tolerance is flagged, a used folder and
overrides the command owns are refused, the summary is written first and the plots are skipped without matplotlib. The real stage comparison is tests/integration/test_compare.py."""

import json
import os
import sys

import pytest

from finetune.commands.compare import compare_losses, write_summary
from tests.helpers import TINY_RECIPE


def _run(name, losses):
    return {"name": name, "run_dir": f"/r/{name}", "stage": int(name[-1]), "offload": False, "losses": losses,
            "steps": list(range(1, len(losses) + 1)), "tokens_per_s_per_gpu": 1.0, "mfu": None, "step_time_s": 1.0,
            "peak_mem_gib": 1.0, "peak_reserved_gib": None, "estimated_gib": 1.0, "final_loss": losses[-1]}


def test_a_stage_beyond_tolerance_is_flagged(tmp_path):
    runs = [_run("zero0", [10.0, 9.0]), _run("zero1", [10.0, 9.019]), _run("zero3", [10.0, 9.05]), _run("zero2", [10.0])]
    compare_losses(runs, 2e-2)
    assert [r["flagged"] for r in runs] == [False, False, True, True]  # zero2 lost a step: flagged too
    assert runs[2]["max_loss_diff"] == pytest.approx(0.05)
    write_summary(str(tmp_path), runs, {"config": "x", "steps": 2, "skip_steps": 1, "gpus": 2, "ranks": "GPUs",
                                        "reference": "zero0", "tolerance": 2e-2, "notes": [], "plots": {}})
    text = (tmp_path / "summary.md").read_text()
    assert text.count("LOSS DIFFERS") == 2
    assert [r["flagged"] for r in json.load(open(tmp_path / "summary.json"))["runs"]] == [False, False, True, True]
    # a failed first stage: the next one that finished becomes the reference
    runs = [{"name": "zero0", "run_dir": "/r/zero0", "error": "exit code 1", "losses": []}, _run("zero1", [10.0, 9.0]),
            _run("zero2", [10.0, 9.001])]
    compare_losses(runs, 2e-2)
    assert [r["flagged"] for r in runs] == [True, False, False]


def test_refuses_a_used_folder_and_owned_overrides(tmp_path):
    from finetune.commands.compare import main

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "x").write_text("")
    assert main(["--config", TINY_RECIPE, "--out", str(tmp_path / "old")]) == 2
    assert main(["--config", TINY_RECIPE, "--out", str(tmp_path / "new"), "train.max_steps=5"]) == 2
    assert not (tmp_path / "new").exists()


def _finished_run(tmp_path, name, losses):
    """A made-up finished stage with a metrics.jsonl in its run folder, as training writes it."""
    run = _run(name, losses)
    run["run_dir"] = str(tmp_path / name)
    (tmp_path / name).mkdir()
    with open(tmp_path / name / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3, "tokens": 256, "tokens_per_s": 500.0,
                                "mfu": None, "peak_mem_gib": 0.5, "peak_reserved_gib": None}) + "\n")
    return run


META = {"config": "x", "steps": 2, "skip_steps": 1, "gpus": 2, "ranks": "CPU processes", "reference": "zero0",
        "tolerance": 1e-4, "notes": [], "plots": {}}


def test_without_matplotlib_the_summary_is_written_and_plots_skipped_with_a_note(tmp_path, monkeypatch, capsys):
    from finetune.commands.compare import summarize

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError, as when not installed
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    runs = [_finished_run(tmp_path, "zero0", [10.0, 9.0]), _finished_run(tmp_path, "zero1", [10.0, 9.0])]
    compare_losses(runs, 1e-4)
    summarize(str(tmp_path), runs, dict(META))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plots skipped: matplotlib is not installed" in err
    assert "pip install 'zerotune[plot]'" in err
    text = (tmp_path / "summary.md").read_text()
    assert "| zero1 | 1 | no |" in text and "Plots: not drawn, matplotlib is not installed" in text
    assert f"zerotune plot {tmp_path / 'zero0'} {tmp_path / 'zero1'} --out" in text  # how to draw them later
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["plots"] == {} and [r["name"] for r in summary["runs"]] == ["zero0", "zero1"]
    assert not list(tmp_path.glob("*.png"))


def test_with_matplotlib_the_summary_names_the_plots(tmp_path, capsys):
    from finetune.commands.compare import summarize

    runs = [_finished_run(tmp_path, "zero0", [10.0, 9.0]), _finished_run(tmp_path, "zero3", [10.0, 9.0])]
    compare_losses(runs, 1e-4)
    summarize(str(tmp_path), runs, dict(META))
    assert capsys.readouterr().err == ""
    assert "Plots: `throughput_memory.png`, `loss_curves.png`" in (tmp_path / "summary.md").read_text()
    summary = json.load(open(tmp_path / "summary.json"))
    assert summary["plots"]["loss_curves.png"]["runs"] == [r["run_dir"] for r in runs] and "plots_note" not in summary
    assert (tmp_path / "throughput_memory.png").stat().st_size > 10_000 and (tmp_path / "loss_curves.png").exists()


def test_a_random_init_recipe_runs_as_given_and_a_missing_model_is_refused_before_any_launch(tmp_path, capsys):
    """No init is saved for a config-only model (every stage draws the same one, finetune/model/init_weights.py): each stage's
    command line carries the user's model.path; a model folder that does not exist ends compare before a launch."""
    from finetune.commands.compare import main, parse_args, run_command
    from tests.helpers import SMALL_VOCAB

    args = parse_args(["--config", TINY_RECIPE, "--out", str(tmp_path / "cmp"), f"model.path={SMALL_VOCAB}"])
    cmd = run_command("zero3", args, 2, 29500)
    assert [a for a in cmd if a.startswith("model.")] == [f"model.path={SMALL_VOCAB}"]
    assert main(["--config", TINY_RECIPE, "--out", str(tmp_path / "cmp"), f"model.path={tmp_path / 'nowhere'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert os.listdir(tmp_path / "cmp") == ["logs"] and not os.listdir(tmp_path / "cmp" / "logs")


def test_the_throughput_column_names_what_a_rank_ran_on(tmp_path):
    meta = {"config": "x", "steps": 2, "skip_steps": 1, "gpus": 2, "reference": "zero0", "tolerance": 2e-2,
            "notes": [], "plots": {}}
    runs = [_run("zero0", [10.0, 9.0])]
    compare_losses(runs, 2e-2)
    for ranks, column in (("GPUs", "| tok/s/GPU |"), ("CPU processes", "| tok/s/rank |")):
        write_summary(str(tmp_path), runs, dict(meta, ranks=ranks))
        assert column in (tmp_path / "summary.md").read_text(), ranks
