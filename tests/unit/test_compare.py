"""`zerotune compare`'s bookkeeping on made-up runs: a stage beyond the loss tolerance is flagged, a used folder and
overrides the command owns are refused. The real stage comparison is tests/integration/test_compare.py."""

import json

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
